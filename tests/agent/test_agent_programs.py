"""Agent programs without a server: resolution, registration, the command contract's errors."""
from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import httpx
import pytest
from grpo_agent import agent, hookimpl
from grpo_agent.plugins import build_registry
from grpo_agent.rollout.agent_programs import (
    AgentCommand,
    AgentFailure,
    resolve_agent,
    run_agent,
    shared_http_client,
)
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


def test_async_agents_share_the_workers_http_pool_with_their_own_keys():
    """Each rollout's client sends its own key over one pool (a pool per rollout costs ~24 ms
    of the worker loop's CPU); an agent closing its client leaves the pool to the others."""
    seen = []

    async def closing_agent(client, row):
        seen.append((client.api_key, client._client))
        async with client:  # closes the client, as an agent may
            return 1.0

    async def main():
        shared = shared_http_client()
        for key in ("k1", "k2"):
            assert await run_agent(closing_agent, "http://127.0.0.1:9/v1", key, {}, 5.0, http_client=shared) == 1.0
        still_open = not shared.is_closed
        await shared.shutdown()
        return shared, still_open

    shared, still_open = asyncio.run(main())
    assert [key for key, _ in seen] == ["k1", "k2"] and all(pool is shared for _, pool in seen)
    assert still_open and shared.is_closed


def test_the_gateway_counts_tool_calls_as_the_tool_loop_does(scripted_loop):
    """The same model turns (a readable and an unreadable call, then an answer) give the same
    `tools/call_frequency` and malformed count through the gateway as through the tool loop."""
    from grpo_agent.rollout.agent import run_tool_loop
    from grpo_agent.rollout.gateway import Gateway, HarnessLimits
    from test_tool_loop import call, multiply
    from transformers.utils import get_json_schema

    texts = [call("multiply", a=3, b=4) + "\n<tool_call>\n{not json\n</tool_call>", "It is 12."]
    prompt = [{"role": "user", "content": "What is 3 times 4?"}]
    looped = asyncio.run(run_tool_loop(scripted_loop(list(texts)), prompt, [multiply], group_id=0))

    loop = scripted_loop(list(texts))
    loop.server = SimpleNamespace(max_model_len=4096, model_id="m")
    loop.model_name = "m"
    scripted = loop.generate_one_turn
    loop.generate_one_turn = lambda prompt_ids, max_tokens=None: scripted(prompt_ids)

    async def through_gateway():
        gateway = Gateway(loop, HarnessLimits())
        await gateway.start()
        session = gateway.open_session(0)
        try:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {session.key}"}) as http:
                for _ in texts:
                    reply = await http.post(gateway.base_url + "/chat/completions", json={
                        "model": "m", "messages": prompt, "tools": [get_json_schema(multiply)]})
                    reply.raise_for_status()
        finally:
            await gateway.stop()
        return session

    session = asyncio.run(through_gateway())
    assert looped.tool_call_count == 2 and looped.metrics["tools/malformed_call_count"] == [1.0]
    assert (session.tool_calls, session.malformed_calls) == (2, 1)


def test_an_sdk_agent_gets_the_tool_loops_prompt_tokens_on_the_counter_task(scripted_loop):
    """The same model turns (two increments, then an answer) through the env's tool loop and
    through the gateway driven by the counter task as an `openai`-SDK agent (the one
    bench/harness_vs_env.py compares): every turn's prompt tokens are equal, and each side is
    one training sequence. What makes their training comparable, turn by turn."""
    import json

    import openai
    from grpo_agent.rollout.agent import run_tool_loop
    from grpo_agent.rollout.gateway import Gateway, HarnessLimits
    from grpo_agent.rollout.reconcile import reconcile_turns
    from grpo_agent_env_counter import CounterEnv
    from test_tool_loop import call
    from transformers.utils import get_json_schema

    texts = [call("increment", step=2), call("increment", step=1), "Done."]
    settings = {"chat_template_kwargs": {"enable_thinking": False}, "max_tool_calling_iterations": 2}
    env = CounterEnv()
    prompt = [{"role": "user", "content": env.reset(target=3)}]
    env_loop = scripted_loop(list(texts), **settings)
    looped = asyncio.run(run_tool_loop(env_loop, prompt, [env.increment], group_id=0))
    assert env.get_reward() == 1.0

    loop = scripted_loop(list(texts), **settings)
    loop.server = SimpleNamespace(max_model_len=4096, model_id="m")
    loop.model_name = "m"
    scripted = loop.generate_one_turn
    loop.generate_one_turn = lambda prompt_ids, max_tokens=None: scripted(prompt_ids)
    schema = get_json_schema(CounterEnv().increment)

    async def sdk_agent(client) -> float:  # bench/harness_vs_env.py's counter_agent
        messages, counter = [dict(m) for m in prompt], 0
        for round_index in range(3):
            choice = (await client.chat.completions.create(
                model="m", messages=messages, tools=[schema])).choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls or round_index == 2:
                break
            for tool_call in choice.message.tool_calls:
                counter += json.loads(tool_call.function.arguments)["step"]
                messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": str(counter)})
        return float(counter == 3)

    async def through_gateway():
        gateway = Gateway(loop, HarnessLimits())
        await gateway.start()
        session = gateway.open_session(0)
        try:
            async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key) as client:
                return await sdk_agent(client), session
        finally:
            await gateway.stop()

    reward, session = asyncio.run(through_gateway())
    assert reward == 1.0 and len(loop.prompts) == len(env_loop.prompts) == 3
    for turn, (ours, theirs) in enumerate(zip(loop.prompts, env_loop.prompts)):
        assert ours == theirs, (turn, loop.tokenizer.decode(ours), loop.tokenizer.decode(theirs))
    assert len(reconcile_turns(session.turns)[0]) == len(reconcile_turns(looped.turns)[0]) == 1


def _command(code: str) -> AgentCommand:
    return AgentCommand(f"{sys.executable} -c {code!r}")


@pytest.mark.parametrize("code, kind, message, timeout_s", [  # 60 s: a sandboxed Python's
    ("import sys; sys.exit(3)", "error", "exited with code 3", 60.0),  # start took > 1 s at
    ("print('great')", "error", "printed 'great'", 60.0),  # load 27 on 2 cores
    ("import time; time.sleep(60)", "timeout", "ran past its 1 s", 1.0),
])
def test_command_agent_failures_name_the_problem(code, kind, message, timeout_s):
    with pytest.raises(AgentFailure, match=message) as raised:
        asyncio.run(run_agent(_command(code), "http://127.0.0.1:9/v1", "k", {}, timeout_s))
    assert raised.value.kind == kind


@pytest.mark.parametrize("reward", [float("inf"), float("-inf"), float("nan")])
def test_an_agent_returning_a_non_finite_reward_fails_its_rollout(reward):
    """inf would poison its group's advantages and NaN would pass for "unscored": either is the
    agent's error (its rollout is dropped), named with the value, not a reward."""
    async def non_finite_agent(client, row):
        return reward

    with pytest.raises(AgentFailure, match=f"returned {reward!r}; an agent returns a finite float") as raised:
        asyncio.run(run_agent(non_finite_agent, "http://127.0.0.1:9/v1", "k", {}, 5.0))
    assert raised.value.kind == "error"


def test_a_command_agent_printing_nan_fails_its_rollout():
    """`float("nan")` reads the line fine, so the command's reward needs the same finite check."""
    with pytest.raises(AgentFailure, match="returned nan; an agent returns a finite float") as raised:
        asyncio.run(run_agent(_command("print('nan')"), "http://127.0.0.1:9/v1", "k", {}, 60.0))
    assert raised.value.kind == "error"


def test_a_run_without_an_answered_call_names_the_refusal_or_where_the_model_is():
    """An agent that caught the 404 of a wrong model name did call: its failure names the
    refusal, not "without calling the model"; a command is pointed at OPENAI_BASE_URL."""
    from grpo_agent.rollout.gateway import AgentSession
    from grpo_agent.rollout.harness import no_reply_failure

    refused = AgentSession(version=0, rejected_calls=2, last_rejection="404 The model 'gpt-4o' does not exist")
    message = str(no_reply_failure(echo_agent, refused))
    assert "refused its 2 call(s), the last with 404 The model 'gpt-4o'" in message
    assert "without calling" not in message
    assert "the client it is given" in str(no_reply_failure(echo_agent, AgentSession(version=0)))
    assert "OPENAI_BASE_URL" in str(no_reply_failure(_command("print(1)"), AgentSession(version=0)))


@pytest.mark.parametrize("uid", [0, 1000])
def test_an_unknown_command_user_is_refused_when_the_limits_are_built(monkeypatch, uid):
    """It used to fail every rollout with a KeyError traceback from the boot script. The name is
    looked up whoever runs the trainer (a non-root one was told only to be root); an existing
    user then needs root, since only root can switch users."""
    from grpo_agent.rollout import command_sandbox
    from grpo_agent.rollout.command_sandbox import CommandLimits

    monkeypatch.setattr(command_sandbox.os, "getuid", lambda: uid)
    with pytest.raises(ValueError, match="user='no-such-user-grpo': no such user on this machine"):
        CommandLimits(user="no-such-user-grpo")
    if uid == 0:
        assert CommandLimits(user="nobody").user == "nobody"
    else:
        with pytest.raises(ValueError, match="user='nobody' needs the trainer to run as root"):
            CommandLimits(user="nobody")


@pytest.mark.parametrize("running_s", [  # cancelled at points of its start, or while it runs
    [0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05], [2.0]])
def test_a_command_cancelled_again_and_again_is_still_killed_and_reaped(caplog, running_s):
    """A worker's shutdown cancels a rollout more than once; the command must still be killed
    and awaited before the loop closes, else asyncio warns "Loop ... that handles pid N is
    closed" (printed for each command in flight at the end of every --agent-cmd run)."""
    import logging
    import time

    async def main(after_s):
        task = asyncio.create_task(run_agent(AgentCommand("sleep 60"), "http://127.0.0.1:9/v1", "k", {}, 60.0))
        started = time.monotonic()
        while time.monotonic() - started < after_s:
            await asyncio.sleep(0)
        for _ in range(50):
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        for after_s in running_s:
            asyncio.run(main(after_s))
        time.sleep(0.5)  # the child watcher's thread reports after the loop closed
    assert "that handles pid" not in caplog.text


def test_a_command_cancelled_once_while_it_starts_is_not_left_running(monkeypatch):
    """One cancel that lands while the command starts (the start is shielded so the process
    group can be killed) still cancels the rollout, at once: it must not be swallowed, leaving
    the command to run to its timeout."""
    import time

    start = asyncio.create_subprocess_exec

    async def main():
        async def start_then_cancel(*args, **kwargs):
            process = await start(*args, **kwargs)
            task.cancel()  # the rollout is cancelled while its command starts
            return process

        monkeypatch.setattr(asyncio, "create_subprocess_exec", start_then_cancel)
        task = asyncio.create_task(run_agent(AgentCommand("sleep 60"), "http://127.0.0.1:9/v1", "k", {}, 60.0))
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        return time.monotonic() - started

    assert asyncio.run(main()) < 5


def test_a_command_cancelled_while_it_is_reaped_still_raises_cancelled(monkeypatch):
    """A cancel that lands while a finished command is killed and reaped is not swallowed:
    the rollout is cancelled, not returned as if it had finished."""
    killpg = os.killpg

    async def main():
        def kill_then_cancel(pid, sig):
            task.cancel()  # arrives while the command is reaped
            killpg(pid, sig)

        monkeypatch.setattr(os, "killpg", kill_then_cancel)
        task = asyncio.create_task(run_agent(_command("print(1.0)"), "http://127.0.0.1:9/v1", "k", {}, 60.0))
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


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


def test_an_agent_that_is_neither_a_function_nor_a_name_is_refused():
    with pytest.raises(TypeError, match="agent must be an async function, an AgentCommand"):
        resolve_agent(42)


@pytest.mark.parametrize("returned", [True, "1.0", [1.0]])
def test_an_agent_returning_a_non_number_fails_its_rollout(returned):
    async def agent_returning(client, row):
        return returned

    import re

    with pytest.raises(AgentFailure, match=re.escape(f"returned {returned!r}; an agent returns a finite")) as raised:
        asyncio.run(run_agent(agent_returning, "http://127.0.0.1:9/v1", "k", {}, 5.0))
    assert raised.value.kind == "error"


def test_an_async_agent_gets_a_copy_of_its_row_and_a_client_closed_after_it():
    """Its int reward comes back a float; what it does to its row stays its own."""
    clients = []

    async def meddling_agent(client, row):
        clients.append(client)
        row["target"] = 0
        return 1

    row = {"target": 3}
    reward = asyncio.run(run_agent(meddling_agent, "http://127.0.0.1:9/v1", "k", row, 5.0))
    assert reward == 1.0 and type(reward) is float
    assert row == {"target": 3} and clients[0].is_closed()


async def hanging(client, row):
    await asyncio.sleep(60)


async def raising(client, row):
    raise ValueError("no counter")


@pytest.mark.parametrize("agent_fn, kind, message", [
    (hanging, "timeout", "The agent 'hanging' ran past its 0.2 s (agent_timeout_s)."),
    (raising, "error", "The agent 'raising' raised ValueError: no counter"),
])
def test_an_async_agent_that_hangs_or_raises_fails_only_its_rollout(agent_fn, kind, message):
    with pytest.raises(AgentFailure) as raised:
        asyncio.run(run_agent(agent_fn, "http://127.0.0.1:9/v1", "k", {}, 0.2))
    assert raised.value.kind == kind and str(raised.value) == message


@pytest.mark.parametrize("printed, reward", [("null", None), ("None", None), ("0.5\\n\\n  \\n", 0.5)])
def test_a_commands_last_non_blank_line_is_its_reward(printed, reward):
    assert asyncio.run(run_agent(_command(f"print('{printed}')"), "http://h/v1", "key", {}, 60.0)) == reward


def test_a_failing_command_is_named_with_the_end_of_its_stderr():
    code = "import sys; sys.stderr.write('start ' + 'x' * 5000 + ' the end'); sys.exit(1)"
    with pytest.raises(AgentFailure, match="exited with code 1. Its stderr ends with:") as raised:
        asyncio.run(run_agent(_command(code), "http://h/v1", "key", {}, 60.0))
    stderr = "start " + "x" * 5000 + " the end"
    assert str(raised.value).split("Its stderr ends with:\n")[1] == stderr[-2000:]


def test_output_is_read_back_by_its_tail():
    import tempfile

    from grpo_agent.rollout.agent_programs import _tail

    with tempfile.TemporaryFile() as handle:
        handle.write(b"a" * 100 + b"0123456789")
        assert _tail(handle, limit=10) == b"0123456789"
        assert _tail(handle, limit=1000) == b"a" * 100 + b"0123456789"


def test_a_command_gets_its_row_as_json_with_other_values_as_text():
    from pathlib import Path

    code = "import json, sys; row = json.load(sys.stdin); print(float(row['path'] == '/data/x' and row['n'] == 2))"
    assert asyncio.run(run_agent(_command(code), "http://h/v1", "key", {"path": Path("/data/x"), "n": 2},
                                 60.0)) == 1.0


@pytest.mark.parametrize("network, base_url, seen", [
    ("gateway", "http://gateway.host:8123/v1", "http://127.0.0.1:8123/v1"),  # its relay's address
    ("gateway", "http://gateway.host/v1", "http://127.0.0.1:80/v1"),  # the relay's port 80
    ("any", "http://gateway.host:8123/v1", "http://gateway.host:8123/v1"),
])
def test_a_command_confined_to_the_gateway_reaches_it_through_its_loopback_relay(network, base_url, seen):
    from grpo_agent.rollout.command_sandbox import CommandLimits

    code = f"import os; print(float(os.environ['OPENAI_BASE_URL'] == {seen!r}))"
    agent = AgentCommand(f"{sys.executable} -c {code!r}", limits=CommandLimits(network=network))
    assert asyncio.run(run_agent(agent, base_url, "key", {}, 60.0)) == 1.0


@pytest.mark.parametrize("stderr, message", [
    ("agent sandbox: cannot create a network namespace (EPERM)",
     "agent sandbox: cannot create a network namespace (EPERM)"),
    ("no namespace for you", "exited with code 97. Its stderr ends with:\nno namespace for you"),
])
def test_a_sandbox_that_could_not_isolate_fails_in_its_own_words(stderr, message):
    """Exit 97 with the sandbox's "agent sandbox:" line is the isolation failing: its message
    alone (not "exited with code 97"); the same code without the line is the agent's exit."""
    code = f"import sys; sys.stderr.write({stderr!r}); sys.exit(97)"
    with pytest.raises(AgentFailure) as raised:
        asyncio.run(run_agent(_command(code), "http://127.0.0.1:9/v1", "k", {}, 60.0))
    assert raised.value.kind == "error"
    assert str(raised.value) == message if stderr.startswith("agent") else str(raised.value).endswith(message)
def test_the_harness_trainer_refuses_before_building_and_hands_its_limits_to_the_loop(
        tiny_model_path, tmp_path):
    """Checked in this process, before any worker: tools/environment_factory (the agent owns
    them), an agent that is not async or does not pickle; the limits reach every rollout loop."""
    from grpo_agent import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
    from grpo_agent.rollout.gateway import HarnessLimits
    from grpo_agent.rollout.harness import HarnessRolloutLoop

    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    common = {"model": str(tiny_model_path), "args": args, "train_dataset": [{"prompt": "go"}]}
    for extra in ({"tools": [len]}, {"environment_factory": dict}):
        with pytest.raises(ValueError, match="owns its tools and environment: drop tools="):
            HarnessAsyncGRPOTrainer(agent="harness_agents:counter_agent", **extra, **common)

    async def local_agent(client, row):
        return 1.0

    with pytest.raises(TypeError, match="Cannot pickle agent = .*local_agent.*an agent registered through"):
        HarnessAsyncGRPOTrainer(agent=local_agent, **common)
    with pytest.raises(TypeError, match="is not an async function"):
        HarnessAsyncGRPOTrainer(agent=len, **common)
    trainer = HarnessAsyncGRPOTrainer(
        agent="harness_agents:counter_agent", agent_timeout_s=30.0, agent_max_calls=5,
        agent_max_tokens=700, agent_max_commands=2, gateway_host="0.0.0.0", gateway_port=8123,
        **common)
    assert trainer.loop_cls.func is HarnessRolloutLoop
    assert trainer.loop_cls.keywords == {
        "agent": "harness_agents:counter_agent",
        "limits": HarnessLimits(timeout_s=30.0, max_calls=5, max_generated_tokens=700,
                                max_commands=2, host="0.0.0.0", port=8123)}
    defaults = HarnessAsyncGRPOTrainer(agent="harness_agents:counter_agent", **common)
    assert defaults.loop_cls.keywords["limits"] == HarnessLimits()  # 600 s, 64 calls, loopback
