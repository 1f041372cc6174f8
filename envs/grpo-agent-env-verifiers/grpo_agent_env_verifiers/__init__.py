"""verifiers tasksets as a grpo-agent env: `--env verifiers --env-arg id=TASKSET --agent verifiers`.

Design decision: verifiers runs in its own venv (`VERIFIERS_VENV`, default `.venv-verifiers`,
built by `make verifiers-venv`), because verifiers 0.4.0 pins openai<3 and mcp==2.0.0 while
grpo-agent's `agents` extra needs openai>=3. Its episodes therefore run as an agent program:
the `verifiers` agent starts `runner.py` in that venv once per rollout with the gateway's
OPENAI_BASE_URL / OPENAI_API_KEY, verifiers plays the episode with its own harness, runtime and
interception server, every model call reaches the policy through the gateway (so the trained
tokens are exactly the sampled ones), and the taskset's own rewards, summed with their weights,
come back as the rollout's reward. The env gives the dataset: the taskset's first `size` tasks.

Each rollout worker keeps one episode server (`runner.py serve`) per venv and plays every
episode there: a process per episode spent about 20 s of a 2-core machine importing verifiers
and loading the taskset, so a training step waited minutes for its groups.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid
import weakref
from collections import deque
from pathlib import Path

from grpo_agent import Option, agent, environment, hookimpl

RUNNER = Path(__file__).with_name("runner.py")
DEFAULT_VENV = ".venv-verifiers"
# Each episode runs verifiers' interception server and a harness program: the rollout worker may
# run hundreds of rollouts at once, so episodes queue for a few slots (a box once ran 252
# episode processes and swapped to a halt). $VERIFIERS_MAX_EPISODES overrides.
MAX_EPISODES = int(os.environ.get("VERIFIERS_MAX_EPISODES") or 0) or max(2, os.cpu_count() or 1)
_episode_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_episode_servers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PR_SET_PDEATHSIG = 1


def _slots() -> asyncio.Semaphore:
    """The running event loop's episode slots (a semaphore belongs to one loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _episode_slots:
        _episode_slots[loop] = asyncio.Semaphore(MAX_EPISODES)
    return _episode_slots[loop]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the rollout worker dies (no orphaned episodes)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class VerifiersVenvMissing(RuntimeError):
    """The verifiers venv is not there; the message says how to build it."""


def venv_python(venv: str = "") -> Path:
    """The verifiers venv's python: `venv`, else $VERIFIERS_VENV, else ./.venv-verifiers."""
    root = Path(venv or os.environ.get("VERIFIERS_VENV") or DEFAULT_VENV).expanduser()
    python = root / "bin" / "python"
    if not python.is_file():
        raise VerifiersVenvMissing(
            f"No verifiers venv at {root.resolve()}: run `make verifiers-venv` in the grpo-agent "
            "checkout (verifiers==0.4.0 in its own venv), or point --env-arg venv=PATH / "
            "VERIFIERS_VENV at one.")
    return python.absolute()


def run_env(python: Path) -> dict[str, str]:
    """The runner's environment: the venv's bin first on PATH (verifiers finds `uv` there)."""
    return {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def task_rows(id: str = "", harness: str = "null", size: int = 100, venv: str = ""):
    """The taskset's first `size` tasks, listed by verifiers in its venv; each row names the
    task and how to play it, for the `verifiers` agent."""
    from datasets import Dataset

    if not id:
        raise ValueError("verifiers needs a taskset: --env-arg id=TASKSET (an installed verifiers "
                         "taskset package, e.g. one built with `vf init`).")
    python = venv_python(venv)
    done = subprocess.run([str(python), str(RUNNER), "tasks", id, str(size)], capture_output=True,
                          text=True, env=run_env(python), timeout=600, check=False)
    tasks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if tasks and "error" in tasks[-1]:  # the runner's one line for a taskset it cannot import
        raise ValueError(tasks[-1]["error"])
    if done.returncode != 0:
        raise ValueError(f"verifiers could not load taskset {id!r}:\n{done.stderr[-2000:]}")
    if not tasks:
        raise ValueError(f"verifiers taskset {id!r} has no tasks.")
    return Dataset.from_list([{**task, "vf_taskset": id, "vf_harness": harness,
                               "vf_python": str(python)} for task in tasks])


@environment(
    "verifiers",
    version=1,
    dataset=task_rows,
    options=[
        Option("id", str, "", "verifiers taskset id (an installed taskset package)"),
        Option("harness", str, "null", "verifiers harness that plays each episode"),
        Option("size", int, 100, "tasks taken from the taskset"),
        Option("venv", str, "", f"the verifiers venv (default $VERIFIERS_VENV or {DEFAULT_VENV})"),
    ],
    description="verifiers tasksets, played by verifiers through the gateway (--agent verifiers).",
)
class VerifiersEnv:
    """The taskset's rows; the episodes are the `verifiers` agent's (train with --agent verifiers)."""

    agent_only = "verifiers"  # `env check` checks the rows, not a reset (grpo_agent.plugins.check)

    def __init__(self, id: str = "", harness: str = "null", size: int = 100, venv: str = ""):
        self.id = id

    def reset(self, **row) -> str:
        raise RuntimeError(
            f"verifiers taskset {self.id!r} is played by verifiers itself: train with "
            "`--agent verifiers` (HarnessAsyncGRPOTrainer(agent='verifiers')).")


class EpisodeServer:
    """The worker's `runner.py serve` process in one venv: episodes go in as JSON lines and
    their rewards come back by id (runner.py says the protocol). It dies with the worker."""

    def __init__(self, python: Path):
        self.python = python
        self.pending: dict[str, asyncio.Future] = {}
        self.stderr_tail: deque[str] = deque(maxlen=40)
        self.process: asyncio.subprocess.Process | None = None
        self.started = asyncio.ensure_future(self._start())

    @property
    def alive(self) -> bool:
        if not self.started.done():
            return True
        if self.started.cancelled() or self.started.exception() is not None:
            return False
        return self.process.returncode is None

    async def _start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            str(self.python), str(RUNNER), "serve", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=run_env(self.python),
            limit=2**24, start_new_session=True, preexec_fn=_die_with_parent)
        self._readers = [asyncio.ensure_future(self._read_answers()),
                         asyncio.ensure_future(self._read_stderr())]

    async def _read_answers(self) -> None:
        while line := await self.process.stdout.readline():
            reply = json.loads(line)
            future = self.pending.get(reply["id"])
            if future is not None and not future.done():
                future.set_result(reply)
        returncode = await self.process.wait()
        error = RuntimeError(f"the verifiers episode server exited {returncode}: "
                             + "".join(self.stderr_tail)[-2000:])
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)

    async def _read_stderr(self) -> None:
        while line := await self.process.stderr.readline():
            self.stderr_tail.append(line.decode(errors="replace"))

    async def _send(self, message: dict) -> None:
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        await self.process.stdin.drain()

    async def play(self, row: dict, base_url: str, api_key: str, model: str) -> float:
        await self.started
        request_id = uuid.uuid4().hex
        future = self.pending[request_id] = asyncio.get_running_loop().create_future()
        try:
            await self._send({"id": request_id, "row": row, "base_url": base_url,
                              "api_key": api_key, "model": model})
            reply = await future
        except asyncio.CancelledError:  # the rollout's time is up: end its episode there
            if self.alive:
                await asyncio.shield(self._send({"cancel": request_id}))
            raise
        finally:
            self.pending.pop(request_id, None)
        if "error" in reply:
            raise RuntimeError(f"verifiers episode failed: {reply['error'][-2000:]}")
        return float(reply["reward"])


def _episode_server(python: Path) -> EpisodeServer:
    """The running event loop's server for `python`'s venv (a new one if it died)."""
    servers = _episode_servers.setdefault(asyncio.get_running_loop(), {})
    server = servers.get(python)
    if server is None or not server.alive:
        server = servers[python] = EpisodeServer(python)
    return server


@agent("verifiers")
async def play(client, row: dict) -> float:
    """One verifiers episode of the row's task, every model call through `client`'s gateway."""
    model = (await client.models.list()).data[0].id
    async with _slots():
        return await _episode_server(Path(row["vf_python"])).play(
            row, str(client.base_url), client.api_key, model)


@hookimpl
def register_environments(register):
    register(VerifiersEnv)


@hookimpl
def register_agents(register):
    register(play)
