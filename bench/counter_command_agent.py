"""The counter task as a command agent for `bench/harness_vs_env.py`: the row on stdin, the
reward on stdout, the gateway in OPENAI_BASE_URL/OPENAI_API_KEY (`--agent-cmd "python
bench/counter_command_agent.py"`).

It speaks HTTP with the standard library, as a curl script would: a process per rollout that
imports `openai` costs about 1 s of CPU on the 2-core box (6-10x the env run's time per step,
measured), which would bury the comparison in start-up time. `INCREMENT` is the schema the
env's tool loop renders for `CounterEnv.increment`, key order included (the bench checks it
against `get_json_schema`); `MAX_ROUNDS` is the demo's `max_tool_calling_iterations`. A row
without a target draws one, as the env's `reset` does.
"""
import json
import os
import random
import sys
import urllib.request

INCREMENT = {"type": "function", "function": {
    "name": "increment", "description": "Increment the internal counter.",
    "parameters": {"type": "object",
                   "properties": {"step": {"type": "integer", "description": "Value to add to the counter."}},
                   "required": ["step"]},
    "return": {"type": "integer", "description": "The updated counter value."}}}
MAX_ROUNDS = 2
MAX_TARGET = 9  # the counter env's
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def call(path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                 "Content-Type": "application/json"})
    with OPENER.open(request, timeout=300) as response:
        return json.load(response)


def main() -> None:
    row = json.load(sys.stdin)
    model = call("/models")["data"][0]["id"]
    target = row["target"] if row.get("target") is not None else random.randint(1, MAX_TARGET)
    messages = [{"role": "user", "content": f"Increment the counter by {target}."}]
    counter = 0
    for round_index in range(MAX_ROUNDS + 1):  # as the env's tool loop: tools run after 2 turns
        choice = call("/chat/completions", {"model": model, "messages": messages,
                                            "tools": [INCREMENT]})["choices"][0]
        message = choice["message"]
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls or choice["finish_reason"] == "length" or round_index == MAX_ROUNDS:
            break
        for tool_call in calls:
            counter += int(json.loads(tool_call["function"]["arguments"]).get("step", 0))
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": str(counter)})
    print(float(counter == target))


if __name__ == "__main__":
    main()
