"""Running one agent program against the gateway: an async function or a command.

An agent is `async def run(client: openai.AsyncOpenAI, row: dict) -> float | None` (its reward,
or None to leave scoring to `reward_funcs`), or a command run per rollout with the gateway in
`OPENAI_BASE_URL`/`OPENAI_API_KEY`, the row as JSON on stdin and its reward as the last line of
stdout (empty or `null`: None), confined by its `CommandLimits` (`command_sandbox`).

Design decision: whatever the agent does wrong (raises, hangs past its timeout, exits
non-zero, returns something that is not a number) becomes an `AgentFailure` for its rollout
only, with a message that names the problem; the caller counts it and drops the rollout.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from grpo_agent.error_text import error_text
from grpo_agent.rollout.command_sandbox import (
    ISOLATION_FAILED_EXIT,
    CommandLimits,
    agent_environment,
    sandboxed_argv,
)

STDERR_TAIL = 2000
OUTPUT_TAIL = 64 * 1024  # bytes of stdout/stderr read back


@dataclass(frozen=True)
class AgentCommand:
    """A command agent: `grpo-agent train --agent-cmd "python my_agent.py"`, run under `limits`."""

    command: str
    cwd: str | None = None
    limits: CommandLimits = field(default_factory=CommandLimits)


class AgentFailure(Exception):
    """The agent failed this rollout; `kind` is "error" or "timeout"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def resolve_agent(ref: Any) -> Callable | AgentCommand:
    """An agent from a callable, an `AgentCommand`, a registered name or `pkg.mod:attr`."""
    if isinstance(ref, AgentCommand) or callable(ref):
        agent = ref
    elif isinstance(ref, str):
        from grpo_agent.plugins.manager import load_registry

        agent = load_registry().resolve_agent(ref)
    else:
        raise TypeError(f"agent must be an async function, an AgentCommand, a registered agent "
                        f"name or 'pkg.module:attr', got {ref!r}.")
    if not isinstance(agent, AgentCommand) and not asyncio.iscoroutinefunction(agent):
        raise TypeError(f"The agent {ref!r} is not an async function: write it as `async def "
                        "run(client: openai.AsyncOpenAI, row: dict) -> float | None`.")
    return agent


def check_reward(value: Any, source: str) -> float | None:
    """The agent's reward as a float (None passes through); anything else is its error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AgentFailure("error", f"{source} returned {value!r}; an agent returns a finite float "
                           "(its reward) or None (score it with reward_funcs).")
    return float(value)


def shared_http_client():
    """One HTTP connection pool for every rollout's `openai.AsyncOpenAI` in a worker.

    A new client per rollout builds its own pool and TLS context: 24 ms of CPU on the worker's
    event loop (measured, against 0.1 ms shared; 220 ms wall on the loaded 2-core box), more
    than a call's own gateway cost. The key stays per rollout (the client sends it per request). An agent that
    closes its client (`async with client:`) must not close the others' pool, so `aclose` is a
    no-op here and the worker calls `shutdown`."""
    import openai

    class SharedHttpClient(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            pass

        async def shutdown(self) -> None:
            await super().aclose()

    return SharedHttpClient()


async def run_agent(agent: Callable | AgentCommand, base_url: str, key: str, row: dict,
                    timeout_s: float, gateway_socket: str | None = None,
                    http_client=None) -> float | None:
    """Run the agent for one rollout; raises `AgentFailure` for anything it does wrong.

    `gateway_socket`: the gateway's Unix socket, which a command confined to the gateway's
    network reaches through its relay (without it, such a command has no network at all).
    `http_client`: the worker's `shared_http_client()` for an async agent's client."""
    if isinstance(agent, AgentCommand):
        home = tempfile.mkdtemp(prefix="grpo-agent-cmd-")
        try:
            return await _run_command(agent, base_url, key, row, timeout_s, gateway_socket, home)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s,
                                http_client=http_client)
    name = getattr(agent, "__name__", repr(agent))
    try:
        value = await asyncio.wait_for(agent(client, dict(row)), timeout_s)
    except asyncio.TimeoutError as error:
        raise AgentFailure("timeout", f"The agent {name!r} ran past its {timeout_s:g} s "
                           "(agent_timeout_s).") from error
    except Exception as error:  # an agent bug costs only its rollout
        raise AgentFailure("error", f"The agent {name!r} raised {error_text(error)}") from error
    finally:
        await client.close()
    return check_reward(value, f"The agent {name!r}")


async def _run_command(agent: AgentCommand, base_url: str, key: str, row: dict, timeout_s: float,
                       gateway_socket: str | None, home: str) -> float | None:
    url = urlsplit(base_url)
    port = url.port or 80  # the gateway's, which the relay listens on
    if agent.limits.network == "gateway":  # the relay listens on loopback inside the namespace
        base_url = url._replace(netloc=f"127.0.0.1:{port}").geturl()
    argv = sandboxed_argv(agent.limits, shlex.split(agent.command), gateway_port=port,
                          gateway_socket=gateway_socket, home=home, timeout_s=timeout_s)
    payload = json.dumps(row, ensure_ascii=False, default=str).encode()
    # Output goes to unnamed files (capped by the file-size limit), so a flood cannot grow
    # the worker's memory; only their tails are read.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # Started and reaped through cancellation: a rollout cancelled while its command
        # starts would leave the process group unkilled (asyncio kills only the child).
        process, cancelled = await _despite_cancellation(asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=out, stderr=err,
            env=agent_environment(base_url, key, home), cwd=agent.cwd, start_new_session=True))
        try:
            if cancelled:
                raise asyncio.CancelledError
            await asyncio.wait_for(_feed_and_wait(process, payload), timeout_s)
        except asyncio.TimeoutError as error:
            raise AgentFailure("timeout", f"The agent command {agent.command!r} ran past its "
                               f"{timeout_s:g} s (agent_timeout_s); it was killed.") from error
        finally:  # its whole process group, also what it left running after it exited
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if (await _despite_cancellation(process.wait()))[1]:
                raise asyncio.CancelledError
        stdout, stderr = _tail(out), _tail(err)
    if process.returncode == ISOLATION_FAILED_EXIT and b"agent sandbox:" in stderr:
        raise AgentFailure("error", stderr.decode(errors="replace").strip())
    if process.returncode != 0:
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:]
        raise AgentFailure("error", f"The agent command {agent.command!r} exited with code "
                           f"{process.returncode}. Its stderr ends with:\n{tail}")
    lines = [line.strip() for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if last in ("", "null", "None"):
        return None
    try:
        value = float(last)
    except ValueError as error:
        raise AgentFailure("error", f"The agent command {agent.command!r} printed {last!r} as its "
                           "last line; print the reward (a number) or nothing.") from error
    return check_reward(value, f"The agent command {agent.command!r}")


async def _despite_cancellation(awaitable) -> tuple[Any, bool]:
    """Await to the end even if cancelled meanwhile: (result, whether it was cancelled).

    For a command's start and its reaping after SIGKILL, both short: a worker's shutdown
    cancels a group and then its rollouts, and a second cancel that cut either short left the
    process to be reaped after the event loop closed (asyncio then printed "Loop ... that
    handles pid N is closed" for every command in flight at the end of an --agent-cmd run)."""
    future = asyncio.ensure_future(awaitable)
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    return future.result(), cancelled


async def _feed_and_wait(process: asyncio.subprocess.Process, payload: bytes) -> None:
    try:
        process.stdin.write(payload)
        await process.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # it did not read its row
    finally:
        process.stdin.close()
    await process.wait()


def _tail(handle, limit: int = OUTPUT_TAIL) -> bytes:
    handle.seek(0, os.SEEK_END)
    handle.seek(max(0, handle.tell() - limit))
    return handle.read()
