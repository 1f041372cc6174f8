"""Command agents run confined: a hostile shell agent reaches the gateway and nothing else.

The gateway here is a stand-in aiohttp app served like the real one (loopback TCP and a Unix
socket); what is under test is the sandbox around the command (`command_sandbox`,
`_agent_boot.py`). The same script run without limits is the control: each attempt it makes
gets through there, so the limits are what block them.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from aiohttp import web
from grpo_agent.rollout.agent_programs import AgentCommand, AgentFailure, run_agent
from grpo_agent.rollout.command_sandbox import CommandLimits

SCRIPT = Path(__file__).with_name("hostile_command_agent.sh")
ATTEMPTS = ["reach another port", "write the trainer's files", "fork 40 processes",
            "allocate 512 MiB", "read HF_TOKEN"]
ALL_BLOCKED = 2 ** len(ATTEMPTS) - 1

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or not all(map(shutil.which, ("curl", "jq", "setsid")))
    or not os.path.exists("/usr/bin/python3"),
    reason="needs root (user switch), curl, jq, setsid and /usr/bin/python3")


@contextlib.asynccontextmanager
async def stand_in_gateway(tmp_path: Path):
    """`GET /v1/models` on loopback and on a Unix socket, plus an unrelated server beside it."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def other(request):
        return web.Response(text="secret")

    gateway, bystander = web.Application(), web.Application()
    gateway.router.add_get("/v1/models", models)
    bystander.router.add_get("/", other)
    runners = [web.AppRunner(gateway), web.AppRunner(bystander)]
    for runner in runners:
        await runner.setup()
    sock = str(tmp_path / "gateway.sock")
    await web.TCPSite(runners[0], "127.0.0.1", 0).start()
    await web.UnixSite(runners[0], sock).start()
    await web.TCPSite(runners[1], "127.0.0.1", 0).start()
    try:
        port, other_port = runners[0].addresses[0][1], runners[1].addresses[0][1]
        yield f"http://127.0.0.1:{port}/v1", sock, other_port
    finally:
        for runner in runners:
            await runner.cleanup()


def run_hostile(tmp_path: Path, limits: CommandLimits) -> tuple[int, Path]:
    forbidden = tmp_path / "trainer-files"
    forbidden.mkdir()

    async def main():
        async with stand_in_gateway(tmp_path) as (url, sock, other_port):
            row = {"other_port": other_port, "forbidden_file": str(forbidden / "pwned")}
            agent = AgentCommand(f"/bin/sh {SCRIPT}", limits=limits)
            return await run_agent(agent, url, "key", row, 60.0, sock)

    reward = asyncio.run(main())
    return int(reward), forbidden / "pwned"


def escaped(mask: int) -> list[str]:
    return [name for bit, name in enumerate(ATTEMPTS) if not mask >> bit & 1]


def leftovers() -> str:
    return subprocess.run(["pgrep", "-af", "sleep 360[78]"], check=False, capture_output=True, text=True).stdout


def test_a_hostile_command_agent_reaches_only_the_gateway(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    limits = CommandLimits(memory_mb=256, max_processes=16, user="nobody")
    mask, pwned = run_hostile(tmp_path, limits)
    assert mask == ALL_BLOCKED, f"got through the sandbox: {escaped(mask)}"
    assert not pwned.exists()
    assert not leftovers(), "a process outlived the agent's run"


def test_without_limits_the_same_agent_gets_through(tmp_path, monkeypatch):
    """The control: no namespace, no user switch, generous memory; only credentials stay out."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    mask, pwned = run_hostile(tmp_path, CommandLimits(network="any", memory_mb=8192))
    daemons = leftovers().split()
    for pid in daemons[::3]:  # "PID sleep 3608" lines: the daemon only a PID namespace ends
        os.kill(int(pid), 9)
    assert escaped(mask) == ATTEMPTS[:4] and pwned.read_text() == "pwned\n"
    assert daemons, "the daemon it started did not outlive the run here"


def test_a_command_that_cannot_start_names_the_problem(tmp_path):
    agent = AgentCommand("/nonexistent/agent")
    with pytest.raises(AgentFailure, match="cannot run '/nonexistent/agent'"):
        asyncio.run(run_agent(agent, "http://127.0.0.1:9/v1", "key", {}, 10.0))
