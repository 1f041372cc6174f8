"""The Responses API as a view of chat (`rollout.responses_api`): what a request means as chat
messages, what it is refused for, the response object and its event stream as the `openai`
client reads them (the gateway round trips are test_gateway_http.py and test_gateway_vllm.py)."""
from __future__ import annotations

import pytest
from grpo_agent.rollout.gateway_errors import GatewayError
from grpo_agent.rollout.responses_api import chat_request, response_body, stream_events

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


@pytest.mark.parametrize("body, param, says", [
    ({"input": []}, "input", "non-empty list of input items"),
    ({"input": "x", "instructions": ["be brief"]}, "instructions", "'instructions' must be a string"),
    ({"input": [3]}, "input[0]", "input[0] must be an object"),
    ({"input": [{"role": "tool", "content": "1"}]}, "input[0].role", "has role 'tool'; use one of"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type", "has type 'computer_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content", "'input_image' content part; only text parts"),
    ({"input": [{"role": "user", "content": ["go"]}]}, "input[0].content", "'str' content part"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content", "a string or a list of text parts"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_file"}]}]},
     "input[0].content", "'input_file' content part"),
    ({"input": "x", "tools": {"type": "function", "name": "f"}}, "tools", "'tools' must be a list"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "'web_search' tool; only function tools"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name",
     "must be a non-empty string (the function's name), got null"),
])
def test_a_request_the_chat_path_cannot_mean_is_a_400_naming_its_field(body, param, says):
    with pytest.raises(GatewayError) as raised:
        chat_request(body, {})
    assert raised.value.status == 400 and raised.value.param == param
    assert says in raised.value.message


def test_input_items_become_chat_messages():
    """A call after a user turn opens a model turn (content None; arguments default to ""),
    a tool output given as parts is their text, empty instructions add no system turn, and
    a flat tool is a chat tool without `strict`, its keys in the agent's order."""
    tool = {"type": "function", "name": "f", "strict": True, "parameters": {"type": "object"},
            "description": "d"}
    messages, conversation, tools = chat_request({"instructions": "", "tools": [tool], "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "1"}, {"type": "output_text", "text": "2"}]}]}, {})
    assert messages == conversation == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12"}]
    assert tools == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "description": "d"}}]
    assert list(tools[0]["function"]) == ["name", "parameters", "description"]


def test_instructions_are_the_system_message_and_past_reasoning_is_skipped():
    """As the OpenAI API reads them: `instructions` lead as the system message (not kept in
    the conversation carried to a chained response) and a reasoning item is accepted and not
    rendered; an unknown previous_response_id is a 404."""
    messages, conversation, _ = chat_request({"instructions": "Be brief.", "input": [
        {"type": "reasoning", "summary": []}, {"role": "user", "content": "go"}]}, {})
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go"}]
    assert conversation == [{"role": "user", "content": "go"}]
    with pytest.raises(GatewayError) as raised:
        chat_request({"input": "x", "previous_response_id": "resp_nope"}, {})
    assert raised.value.status == 404 and raised.value.param == "previous_response_id"


def test_chaining_leaves_the_remembered_response_as_it_was():
    """A request that continues a response (previous_response_id) and adds a call to its
    model turn must not change what the rollout remembers: a second request chaining the
    same response sees it as answered."""
    reply = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    history = {"resp_1": [{"role": "user", "content": "go"}, reply]}
    more = {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"}
    chained, _, _ = chat_request({"previous_response_id": "resp_1", "input": [more]}, history)
    assert [c["id"] for c in chained[-1]["tool_calls"]] == ["c1", "c2"]
    assert history["resp_1"][1] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    again, _, _ = chat_request({"previous_response_id": "resp_1", "input": "next"}, history)
    assert [c["id"] for c in again[1]["tool_calls"]] == ["c1"]


def test_a_reply_cut_by_max_tokens_is_an_incomplete_response_with_only_its_call():
    from openai.types.responses import Response

    reply = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    _, body = response_body("m", reply, "length", (5, 2), None, None)
    parsed = Response.model_validate(body)
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in parsed.output] == ["function_call"]
    assert parsed.usage.total_tokens == 7 and parsed.tool_choice == "auto" and parsed.tools == []
    _, done = response_body("m", {"role": "assistant", "content": "hi"}, "stop", (5, 2), None, "none")
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["tool_choice"] == "none"


def _client_stream(response: dict) -> list:
    """The events as the `openai` client's stream state reads them (`client.responses.stream`)."""
    from openai import omit
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    state = ResponseStreamState(input_tools=omit, text_format=omit)
    return [out for event in stream_events(response)
            for out in state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))]


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_the_event_stream_builds_the_reply_in_the_clients_stream_state(finish):
    """Numbered events; the lifecycle events carry the pending response (in progress, no
    output, no usage) until the last, which is the response itself; the text and arguments
    arrive whole, each once."""
    reply = {"role": "assistant", "content": "On it.", "tool_calls": [CALL]}
    _, response = response_body("m", reply, finish, (5, 2), None, None)
    raw = stream_events(response)
    assert [event["sequence_number"] for event in raw] == list(range(len(raw)))
    for event in raw[:2]:
        assert event["response"]["status"] == "in_progress"
        assert event["response"]["output"] == [] and event["response"]["usage"] is None
    assert raw[-1]["response"] == response and response["status"] != "in_progress"
    events = _client_stream(response)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed" if finish == "tool_calls" else "response.incomplete"]
    assert events[4].snapshot == "On it." and events[9].snapshot == '{"a": 1}'
    assert events[-1].response.output[1].call_id == "c1"
