"""Agent programs without a server: resolution, registration, the command contract's errors."""
from __future__ import annotations

import asyncio
import sys

import pytest
from grpo_agent import agent, hookimpl
from grpo_agent.plugins import build_registry
from grpo_agent.rollout.agent_programs import AgentCommand, AgentFailure, resolve_agent, run_agent
from grpo_agent.rollout.gateway import GatewayError, template_messages


@agent("echo")
async def echo_agent(client, row):
    return 1.0


class AgentPlugin:
    @hookimpl
    def register_agents(self, register):
        register(echo_agent)


def test_register_agents_hook_and_resolution():
    registry = build_registry(AgentPlugin())
    assert registry.agents == {"echo": echo_agent}
    assert registry.resolve_agent("echo") is echo_agent
    assert resolve_agent("harness_agents:counter_agent").__name__ == "counter_agent"
    with pytest.raises(TypeError, match="not an async function"):
        resolve_agent(lambda client, row: 1.0)


def _command(code: str) -> AgentCommand:
    return AgentCommand(f"{sys.executable} -c {code!r}")


@pytest.mark.parametrize("code, kind, message", [
    ("import sys; sys.exit(3)", "error", "exited with code 3"),
    ("print('great')", "error", "printed 'great'"),
    ("import time; time.sleep(60)", "timeout", "ran past its 1 s"),
])
def test_command_agent_failures_name_the_problem(code, kind, message):
    with pytest.raises(AgentFailure, match=message) as raised:
        asyncio.run(run_agent(_command(code), "http://127.0.0.1:9/v1", "k", {}, 1.0))
    assert raised.value.kind == kind


def test_command_agent_gets_the_gateway_and_row_and_returns_its_last_line():
    code = ("import json, os, sys; row = json.load(sys.stdin); "
            "print(os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY']); print(row['x'] / 2)")
    assert asyncio.run(run_agent(_command(code), "http://h/v1", "key", {"x": 3}, 10.0)) == 1.5
    assert asyncio.run(run_agent(_command("print()"), "http://h/v1", "key", {}, 10.0)) is None


def test_openai_messages_render_like_the_tool_loops():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = template_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(GatewayError, match="non-empty list"):
        template_messages([])


def test_responses_input_items_become_the_chat_conversation_and_the_reply_parses():
    from grpo_agent.rollout.responses_api import chat_request, response_body
    from openai.types.responses import Response

    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    body = {"instructions": "be brief", "tools": [tool], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "summary": []}]}
    messages, conversation, tools = chat_request(body, {})
    assert messages[0] == {"role": "system", "content": "be brief"} and messages[1:] == conversation
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool"]  # one model turn
    assert [c["id"] for c in conversation[1]["tool_calls"]] == ["c1", "c2"]
    assert tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                       "parameters": {"type": "object"}}}]
    reply = {"role": "assistant", "content": "hi", "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    response_id, body_out = response_body("m", reply, "tool_calls", (5, 2), [tool], None)
    parsed = Response.model_validate(body_out)  # what client.responses.create builds
    assert parsed.output_text == "hi" and parsed.output[1].call_id == "c3"
    chained, _, _ = chat_request({"previous_response_id": response_id, "input": [
        {"type": "function_call_output", "call_id": "c3", "output": "2"}]},
        {response_id: [*conversation, reply]})
    assert chained[-2] == reply and chained[-1]["role"] == "tool"  # no instructions carried over
    with pytest.raises(GatewayError, match="only function tools"):
        chat_request({"input": "x", "tools": [{"type": "web_search"}]}, {})
    with pytest.raises(GatewayError, match="No response 'resp_x'"):
        chat_request({"input": "x", "previous_response_id": "resp_x"}, {})


@pytest.fixture
def cli(capsys):
    def run(*args):
        from grpo_agent.cli.main import main

        with pytest.raises(SystemExit) as done:
            main(list(args))
        captured = capsys.readouterr()
        return done.value.code or 0, captured.out, captured.err

    return run


def test_cli_resolves_the_agent_before_training(cli):
    code, _, err = cli("train", "--env", "counter", "--agent", "nope", "--dry-run")
    assert code != 0 and "Unknown agent 'nope'" in err
    code, _, err = cli("train", "--env", "counter", "--agent", "x", "--agent-cmd", "y", "--dry-run")
    assert code != 0 and "not both" in err
