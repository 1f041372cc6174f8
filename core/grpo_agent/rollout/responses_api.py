"""The Responses API (`/v1/responses`) as a view of Chat Completions, for the gateway.

Design decision: a Responses request is translated into the chat messages and tools it means
(`instructions` as the system message, `function_call` items as the assistant's `tool_calls`,
`function_call_output` items as tool messages, flat function tools as chat tools with the same
keys in the same order), then sampled exactly as a chat call, so the token guarantees are the chat path's.
The reply's assistant message becomes output items: an output_text message and one
`function_call` item per parsed call. `previous_response_id` is resolved from the rollout's own
earlier responses (a rollout's conversation is never shared). `stream=true` replays the
finished reply as the Responses event sequence (`stream_events`). Not supported: built-in
tools (web search, file search) and non-text input parts.
"""
from __future__ import annotations

import time
import uuid

from grpo_agent.rollout.gateway_errors import GatewayError, check_tool_name

_CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_request(body: dict, history: dict[str, list[dict]]) -> tuple[list[dict], list[dict], list[dict] | None]:
    """The chat messages and tools a Responses request means.

    `history`: this rollout's earlier responses by id, each its conversation including the
    reply, without instructions (which, as in the OpenAI API, are not carried over). Returns
    the messages to render, the conversation to remember, and the chat tools."""
    conversation: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if previous not in history:
            raise GatewayError(404, f"No response {previous!r} in this rollout: previous_response_id "
                               "must name a response this rollout's key received.",
                               code="response_not_found", param="previous_response_id")
        # each message and its tool_calls list copied: a function_call item joins the last
        # model turn's list, which must not change the remembered response
        conversation = [{**m, "tool_calls": list(m["tool_calls"])} if m.get("tool_calls") else dict(m)
                        for m in history[previous]]
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise GatewayError(400, "'input' must be a string or a non-empty list of input items.",
                           param="input")
    for index, item in enumerate(items):
        _append_item(conversation, item, index)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError(400, "'instructions' must be a string.", param="instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    return [*system, *conversation], conversation, _chat_tools(body.get("tools"))


def _append_item(messages: list[dict], item, index: int) -> None:
    if not isinstance(item, dict):
        raise GatewayError(400, f"input[{index}] must be an object.", param=f"input[{index}]")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _CHAT_ROLES:
            raise GatewayError(400, f"input[{index}] has role {role!r}; use one of {list(_CHAT_ROLES)}.",
                               param=f"input[{index}].role")
        messages.append({"role": role, "content": _text(item.get("content"), index)})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        last = messages[-1] if messages else None
        if last is not None and last.get("role") == "assistant":
            last.setdefault("tool_calls", []).append(call)  # the same model turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, index)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    elif kind == "reasoning":
        return  # the training template does not render past reasoning
    else:
        raise GatewayError(400, f"input[{index}] has type {kind!r}; this gateway reads message, "
                           "function_call, function_call_output and reasoning items.",
                           param=f"input[{index}].type")


def _text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise GatewayError(400, f"input[{index}] has a {kind!r} content part; only text parts "
                                   "are supported.", param=f"input[{index}].content")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise GatewayError(400, f"input[{index}].content must be a string or a list of text parts.",
                       param=f"input[{index}].content")


def _chat_tools(tools) -> list[dict] | None:
    """Flat Responses function tools as chat tools, keys in the agent's order (it is rendered)."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise GatewayError(400, "'tools' must be a list of function tools.", param="tools")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise GatewayError(400, f"tools[{index}] is a {kind!r} tool; only function tools run here "
                               "(the agent executes them).", param=f"tools[{index}]")
        check_tool_name(tool.get("name"), f"tools[{index}].name")
        function = {k: v for k, v in tool.items() if k not in ("type", "strict")}  # order kept
        out.append({"type": "function", "function": function})
    return out


def response_body(model: str, message: dict, finish: str, usage: tuple[int, int],
                  tools: list | None, tool_choice) -> tuple[str, dict]:
    """The Responses object for an assistant reply; returns its id too."""
    output = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "status": "completed",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"]})
    prompt, completion = usage
    response_id = f"resp_{uuid.uuid4().hex}"
    return response_id, {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if finish == "length" else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "output": output, "parallel_tool_calls": True, "tool_choice": tool_choice or "auto",
        "tools": tools or [], "error": None,
        "usage": {"input_tokens": prompt, "output_tokens": completion,
                  "total_tokens": prompt + completion,
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def stream_events(response: dict) -> list[dict]:
    """The finished `response` as the Responses API's server-sent events, in the order the
    `openai` client's stream state expects: created, in_progress, then per output item
    added / its text or arguments (one delta: the turn is already generated) / done, then
    completed (or incomplete when the reply ran out of tokens)."""
    pending = {**response, "status": "in_progress", "output": [], "incomplete_details": None,
               "usage": None}
    events: list[dict] = [{"type": "response.created", "response": pending},
                          {"type": "response.in_progress", "response": pending}]
    for index, item in enumerate(response["output"]):
        place = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **place, "content_index": 0,
                 "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", **place, "content_index": 0,
                 "delta": part["text"], "logprobs": []},
                {"type": "response.output_text.done", **place, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **place, "content_index": 0, "part": part}]
        else:  # function_call
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **place, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **place, "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": f"response.{response['status']}", "response": response})
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]
