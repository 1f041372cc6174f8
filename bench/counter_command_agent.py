"""The counter task as a command agent for `bench/harness_vs_env.py`: the sync `openai` client,
the row on stdin, the reward on stdout (`--agent-cmd "python bench/counter_command_agent.py"`).

`INCREMENT` is the schema the env's tool loop renders for `IncrementEnv.increment`, key order
included (the bench checks it against `get_json_schema`), written out so that a run does not
import transformers.
"""
import json
import sys

INCREMENT = {"type": "function", "function": {
    "name": "increment", "description": "Increment the internal counter.",
    "parameters": {"type": "object",
                   "properties": {"step": {"type": "integer", "description": "Value to add to the counter."}},
                   "required": ["step"]},
    "return": {"type": "integer", "description": "The updated counter value."}}}


def main() -> None:
    from openai import OpenAI

    row = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the gateway
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": f"Increment the counter by {row['target']}."}]
    counter = 0
    for _ in range(3):
        message = client.chat.completions.create(model=model, messages=messages,
                                                 tools=[INCREMENT]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            counter += int(json.loads(call.function.arguments).get("step", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(counter)})
    print(float(counter == row["target"]))


if __name__ == "__main__":
    main()
