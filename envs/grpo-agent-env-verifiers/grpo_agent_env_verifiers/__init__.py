"""verifiers tasksets as a grpo-agent env: `--env verifiers --env-arg id=TASKSET --agent verifiers`.

Design decision: verifiers runs in its own venv (`VERIFIERS_VENV`, default `.venv-verifiers`,
built by `make verifiers-venv`), because verifiers 0.4.0 pins openai<3 and mcp==2.0.0 while
grpo-agent's `agents` extra needs openai>=3. Its episodes therefore run as an agent program:
the `verifiers` agent starts `runner.py` in that venv once per rollout with the gateway's
OPENAI_BASE_URL / OPENAI_API_KEY, verifiers plays the episode with its own harness, runtime and
interception server, every model call reaches the policy through the gateway (so the trained
tokens are exactly the sampled ones), and the taskset's own rewards, summed with their weights,
come back as the rollout's reward. The env gives the dataset: the taskset's first `size` tasks.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import weakref
from pathlib import Path

from grpo_agent import Option, agent, environment, hookimpl

RUNNER = Path(__file__).with_name("runner.py")
DEFAULT_VENV = ".venv-verifiers"
# Each episode is a Python process with verifiers' own servers and programs: the rollout worker
# may run hundreds of rollouts at once, so episodes queue for a few slots (a box once ran 252 and
# swapped to a halt). $VERIFIERS_MAX_EPISODES overrides.
MAX_EPISODES = int(os.environ.get("VERIFIERS_MAX_EPISODES") or 0) or max(2, os.cpu_count() or 1)
_episode_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
    if done.returncode != 0:
        raise ValueError(f"verifiers could not load taskset {id!r}:\n{done.stderr[-2000:]}")
    tasks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
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

    def __init__(self, id: str = "", harness: str = "null", size: int = 100, venv: str = ""):
        self.id = id

    def reset(self, **row) -> str:
        raise RuntimeError(
            f"verifiers taskset {self.id!r} is played by verifiers itself: train with "
            "`--agent verifiers` (HarnessAsyncGRPOTrainer(agent='verifiers')).")


@agent("verifiers")
async def play(client, row: dict) -> float:
    """One verifiers episode of the row's task, every model call through `client`'s gateway."""
    python = Path(row["vf_python"])
    env = {**run_env(python), "OPENAI_BASE_URL": str(client.base_url),
           "OPENAI_API_KEY": client.api_key}
    async with _slots():
        process = await asyncio.create_subprocess_exec(
            str(python), str(RUNNER), "episode", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
            start_new_session=True, preexec_fn=_die_with_parent)
        try:
            out, err = await process.communicate(json.dumps(row).encode())
        except asyncio.CancelledError:  # the rollout's time is up: end verifiers and its programs
            os.killpg(process.pid, signal.SIGKILL)
            raise
    if process.returncode != 0:
        raise RuntimeError(f"verifiers episode exited {process.returncode}: "
                           f"{err.decode(errors='replace')[-2000:]}")
    return float(out.decode().strip().splitlines()[-1])


@hookimpl
def register_environments(register):
    register(VerifiersEnv)


@hookimpl
def register_agents(register):
    register(play)
