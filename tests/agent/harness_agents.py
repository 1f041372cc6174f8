"""Agent programs for the gateway tests, importable by name in the spawned rollout worker.

They use only the public `openai` SDK, as a user's agent would. The counter task is the spec's
IncrementEnv written as an agent: the model calls `increment`, the agent runs it and answers.
"""
from __future__ import annotations

import asyncio
import json

from grpo_agent import agent

INCREMENT_TOOL = {
    "type": "function",
    "function": {
        "name": "increment",
        "description": "Increment the internal counter.",
        "parameters": {
            "type": "object",
            "properties": {"step": {"type": "integer", "description": "Value to add to the counter."}},
            "required": ["step"],
        },
        "return": {"type": "integer", "description": "The updated counter value."},
    },
}


async def model_name(client) -> str:
    return (await client.models.list()).data[0].id


@agent("counter")
async def counter_agent(client, row: dict) -> float:
    """Increment a counter to the row's target through tool calls; reward 1 on the target."""
    model = await model_name(client)
    messages = [{"role": "user", "content": f"Increment the counter by {row['target']}."}]
    counter = 0
    for _ in range(3):
        response = await client.chat.completions.create(model=model, messages=messages, tools=[INCREMENT_TOOL])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            counter += int(json.loads(call.function.arguments).get("step", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(counter)})
    return float(counter == row["target"])


RESPONSES_TOOL = {"type": "function", **INCREMENT_TOOL["function"]}  # the Responses API's flat form


@agent("counter-responses")
async def responses_counter_agent(client, row: dict) -> float:
    """The counter task through `client.responses.create`, sending the whole history each call
    (its output items, then a `function_call_output` per call), or, with `row["chain"]`, only
    the new items after `previous_response_id`; with `row["stream"]`, through
    `client.responses.stream`."""
    model = await model_name(client)
    items = [{"role": "user", "content": f"Increment the counter by {row['target']}."}]
    counter, previous = 0, None
    for _ in range(3):
        request = {"model": model, "input": items, "tools": [RESPONSES_TOOL], "previous_response_id": previous}
        if row.get("stream"):
            response = await streamed_response(client, request)
        else:
            response = await client.responses.create(**request)
        calls = [item for item in response.output if item.type == "function_call"]
        if row.get("chain"):
            items, previous = [], response.id
        else:
            items += [item.model_dump(exclude_none=True) for item in response.output]
        if not calls:
            break
        for call in calls:
            counter += int(json.loads(call.arguments).get("step", 0))
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": str(counter)})
    return float(counter == row["target"])


async def streamed_response(client, request: dict):
    """The final response of a streamed Responses call; raises unless the deltas the client
    accumulated are exactly the final items (text and call arguments)."""
    text, arguments, final = "", {}, None
    async with client.responses.stream(**request) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.function_call_arguments.delta":
                arguments[event.item_id] = arguments.get(event.item_id, "") + event.delta
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    if final is None:
        raise RuntimeError("the stream ended without response.completed or response.incomplete")
    final_text = "".join(part.text for item in final.output if item.type == "message" for part in item.content)
    final_arguments = {item.id: item.arguments for item in final.output if item.type == "function_call"}
    if (text, arguments) != (final_text, final_arguments):
        raise RuntimeError(f"streamed {(text, arguments)!r} but the response holds {(final_text, final_arguments)!r}")
    return final


async def chat_agent(client, row: dict) -> float:
    """A multi-turn chat without tools: each reply goes back into the history with a new user
    message, for `row["turns"]` calls of at most `row["max_tokens"]` tokens."""
    model = await model_name(client)
    messages = [{"role": "user", "content": "Increment the counter by 1."}]
    for number in range(row["turns"]):
        if number:
            messages.append({"role": "user", "content": f"Now by {number + 1}."})
        response = await client.chat.completions.create(model=model, messages=messages,
                                                         max_tokens=row["max_tokens"])
        messages.append(response.choices[0].message.model_dump(exclude_none=True))
    return 1.0


async def one_call_agent(client, row: dict) -> None:
    await client.chat.completions.create(model=await model_name(client), messages=row["prompt"])
    # None: reward_funcs score it


async def raising_agent(client, row: dict) -> float:
    await one_call_agent(client, row)
    raise RuntimeError("agent bug")


async def hanging_agent(client, row: dict) -> float:
    await one_call_agent(client, row)
    await asyncio.sleep(3600)
    return 1.0


async def non_number_agent(client, row: dict):
    await one_call_agent(client, row)
    return "great"


async def silent_agent(client, row: dict) -> float:
    return 1.0


async def unknown_model_agent(client, row: dict) -> float:
    await client.chat.completions.create(model="gpt-nonexistent", messages=row["prompt"])
    return 1.0


async def agents_sdk_counter(client, row: dict) -> float:
    """The counter task written with the OpenAI Agents SDK (`pip install openai-agents`)."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    counter = {"value": 0}

    @function_tool
    def increment(step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        counter["value"] += step
        return counter["value"]

    model = OpenAIChatCompletionsModel(model=await model_name(client), openai_client=client)
    runner_agent = Agent(name="counter", tools=[increment], model=model)
    try:
        await Runner.run(runner_agent, f"Increment the counter by {row['target']}.", max_turns=3)
    except MaxTurnsExceeded:
        pass  # the model kept calling the tool: score what it reached
    return float(counter["value"] == row["target"])


async def over_budget_agent(client, row: dict) -> float:
    """Calls twice under a one-call budget: the second call must come back as a 429."""
    import openai

    await one_call_agent(client, row)
    try:
        await one_call_agent(client, row)
    except openai.RateLimitError as error:
        return float(error.code == "rollout_call_budget")
    return 0.0


async def odd_target_fails_agent(client, row: dict) -> None:
    """One call; raises on odd targets (dropped rollouts), else None (reward_funcs score it)."""
    messages = [{"role": "user", "content": f"Increment the counter by {row['target']}."}]
    await client.chat.completions.create(model=await model_name(client), messages=messages)
    if row["target"] % 2:
        raise RuntimeError("agent bug on odd targets")
