"""The Responses API as a view of chat (`rollout.responses_api`): what a request means as chat
messages, what it is refused for, the response object and its event stream as the `openai`
client reads them (the gateway round trips are test_gateway_http.py and test_gateway_vllm.py)."""
from __future__ import annotations

from grpo_agent.rollout.responses_api import chat_request

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


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
