"""OpenEnv by URL: the shipped guess-number env served by openenv-core's own server (a real
uvicorn subprocess on a local port), played through `--env-arg url=`, one session per episode."""
from __future__ import annotations

import os
import signal
import time

import pytest
from grpo_agent.plugins import load_environment

pytest.importorskip("openenv.core")

from grpo_agent_env_openenv import OpenEnvEnv
from grpo_agent_env_openenv.remote import OpenEnvServerError
from grpo_agent_env_openenv.serve import serving

GUESS_32 = {"type": "call_tool", "tool_name": "guess", "arguments": {"number": 32}}


@pytest.fixture(scope="module")
def server():
    with serving() as process:
        yield process


def test_gold_play_by_url_through_the_registry_wins_and_reads_like_in_process(server):
    spec = load_environment("openenv", url=server.url, size=3, seed=5)
    assert spec.load_dataset()["seed"] == [5, 6, 7]
    env, local = spec(), OpenEnvEnv()
    prompt = env.reset(seed=5)
    assert prompt == local.reset(seed=5)  # same task, same tool list (MCP tools/list), same words
    assert "from 1 to 64" in prompt and '"name": "guess"' in prompt, prompt
    assert env.step(GUESS_32) == local.step(GUESS_32)  # the seed fixes the secret on the server too
    env.reset(seed=5)
    spec.gold(env, {"seed": 5})
    assert env.done and env.get_reward() == 1.0  # the server's step rewards, summed
    with pytest.raises(RuntimeError, match="The episode is over"):
        env.step(GUESS_32)


def test_a_refused_action_is_the_tool_answer_and_the_session_goes_on(server):
    env = load_environment("openenv", url=server.url)()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="the environment refused the message: Invalid message.*tool_name"):
        env.step({"word": "x"})
    assert env.step({"type": "call_tool", "tool_name": "nope", "arguments": {}}) == "error: Unknown tool: 'nope'"
    assert env.step(GUESS_32) in ("higher", "lower") or env.done
    env.get_reward()


def test_one_session_per_episode_and_a_full_server_says_how_to_fix_it():
    with serving(max_sessions=2) as server:
        _fill_and_free(server)


def _fill_and_free(server):
    first, second, third = (load_environment("openenv", url=server.url)() for _ in range(3))
    first.reset(seed=0)
    second.reset(seed=1)
    with pytest.raises(OpenEnvServerError, match=rf"server at {server.url} has no free session "
                       r"\(Server at capacity: 2/2.*max_concurrent_rollouts to at most 2"):
        third.reset(seed=2)
    assert first.get_reward() == 0.0  # scoring the episode closes its session ...
    _reset_once_free(third, seed=2)  # ... which the server frees once it reads the close
    second.reset(seed=3)  # a new episode on the same instance replaces its session: no slot leak
    del second  # an instance dropped mid-episode gives its slot back too
    fourth = load_environment("openenv", url=server.url)()
    _reset_once_free(fourth, seed=4)


def _reset_once_free(env, seed: int, wait_s: float = 60.0) -> None:
    """Reset `env`, retrying while the server is full: it frees a closed session when its
    WebSocket loop reads the close, a moment after the client sent it (a wait, not a timing
    claim: a slot that is never freed fails after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            env.reset(seed=seed)
            return
        except OpenEnvServerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_an_unreachable_server_and_a_bad_url_name_the_fix():
    from grpo_agent.sampler.server import find_free_port

    url = f"http://127.0.0.1:{find_free_port()}"
    env = load_environment("openenv", url=url)()
    with pytest.raises(OpenEnvServerError, match=rf"cannot reach the OpenEnv server at {url} .*"
                       r"python -m grpo_agent_env_openenv.serve --port PORT.*fix --env-arg url="):
        env.reset(seed=0)
    with pytest.raises(ValueError, match=r"url='localhost:8000' must be an http\(s\):// or ws\(s\)://"):
        load_environment("openenv", url="localhost:8000")()


def test_a_server_that_dies_mid_episode_loses_the_episode_and_costs_its_group():
    from grpo_agent.rollout.group_failures import ENV_ERROR, failure_reason

    with serving() as process:
        env = load_environment("openenv", url=process.url)()
        env.reset(seed=0)
        assert env.step(GUESS_32) in ("higher", "lower", "correct")
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        with pytest.raises(OpenEnvServerError, match=rf"server at {process.url} lost the session mid-episode"):
            env.step(GUESS_32)  # the model reads this as the tool's answer
        with pytest.raises(OpenEnvServerError, match="lost the session mid-episode") as lost:
            env.get_reward()  # not a score: the runner drops the group
        assert failure_reason(_finish_error(env, lost.value)) == ENV_ERROR
        with pytest.raises(OpenEnvServerError, match="cannot reach the OpenEnv server"):
            env.reset(seed=1)


def _finish_error(env, error):
    """What the rollout worker's EnvironmentRunner raises when `get_reward` raises `error`."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from grpo_agent.rollout.environments import EnvEpisode, EnvironmentRunner

    runner = EnvironmentRunner(OpenEnvEnv, ThreadPoolExecutor(1))
    episode = EnvEpisode(env=env, prompt=[], tools=[], reset_s=0.0, pool_key="OpenEnvEnv")
    env.lost = error
    with pytest.raises(Exception) as raised:
        asyncio.run(runner.finish(episode))
    return raised.value


def test_env_check_by_url_through_the_cli(server, capsys):
    from grpo_agent.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["env", "check", "openenv", "--env-arg", f"url={server.url}"])
    out = capsys.readouterr().out
    assert not done.value.code and "all 9 steps passed" in out, out
