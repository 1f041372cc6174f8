"""The counter task as a command agent: the sync `openai` client, the row on stdin, the reward
on the last line of stdout (the `--agent-cmd` contract)."""
import json
import sys

from openai import OpenAI

INCREMENT_TOOL = {"type": "function", "function": {  # key order as the model was warmed on
    "name": "increment", "description": "Increment the internal counter.",
    "parameters": {"type": "object",
                   "properties": {"step": {"type": "integer", "description": "Value to add to the counter."}},
                   "required": ["step"]},
    "return": {"type": "integer", "description": "The updated counter value."}}}

row = json.load(sys.stdin)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the gateway
model = client.models.list().data[0].id
messages = [{"role": "user", "content": f"Increment the counter by {row['target']}."}]
counter = 0
for _ in range(3):
    message = client.chat.completions.create(model=model, messages=messages, tools=[INCREMENT_TOOL]).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        counter += int(json.loads(call.function.arguments).get("step", 0))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(counter)})
print("log lines before the reward are ignored")
print(float(counter == row["target"]))
