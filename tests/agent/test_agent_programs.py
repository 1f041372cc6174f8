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
