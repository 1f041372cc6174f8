"""Hook specifications of the `grpo_agent` plugin host.

Design decision: every hook is a *registration* hook. It receives a `register` callable (or
the typer app) and hands it the objects the plugin provides; plugins never touch a global
registry. The host calls each hook once at start-up and resolves the results into plain
dictionaries (`grpo_agent.plugins.registry.Registry`), so the rollout and training loops never
call `pm.hook`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "grpo_agent"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[..., None]


# ---- environments and tools -------------------------------------------------------------


@hookspec
def register_environments(register: Register) -> None:
    """Register environment classes: `register(EnvClass)`.

    The class must be marked with `@environment("name", ...)` (or pass `name=` to `register`).
    It needs `reset(**row) -> str | None`; `get_reward() -> float` is optional; its other
    public methods become the rollout's tools.
    """


@hookspec
def register_tools(register: Register) -> None:
    """Register stand-alone tool functions: `register(fn, name=None)`.

    Tools need type hints and a Google-style docstring: their JSON schema is derived from them.
    """


@hookspec
def register_agents(register: Register) -> None:
    """Register agent programs: `register(fn, name=None)` (trained by HarnessAsyncGRPOTrainer).

    Signature `async def run(client: openai.AsyncOpenAI, row: dict) -> float | None`, marked
    with `@agent("name")`; it talks to the policy only through `client` (the gateway).
    """


# ---- scoring ----------------------------------------------------------------------------


@hookspec
def register_rewards(register: Register) -> None:
    """Register reward functions: `register(fn, name=None)`.

    Signature `(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]`,
    sync or async; `None` means "cannot score this completion".
    """


@hookspec
def register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators: `register(fn, name=None)`.

    Signature `(group: RolloutGroup) -> np.ndarray` with one advantage per rollout; selected by
    the config field `advantage_estimator`.
    """


@hookspec
def register_prompt_filters(register: Register) -> None:
    """Register prompt filters: `register(fn, name=None)`.

    Signature `(row_index: int, row: dict, epoch: int) -> bool` (True keeps the prompt);
    selected by the config field `prompt_filters`, all of which must accept a prompt.
    """


# ---- command line -----------------------------------------------------------------------


@hookspec
def register_commands(app: Any) -> None:
    """Add commands or sub-apps to the root `typer.Typer` of the `grpo-agent` CLI.

    Import heavy libraries inside the command bodies so `grpo-agent --help` stays fast.
    """


# The registration hooks and the kind of object each registers (the registry's kinds).
HOOK_KINDS = {
    "register_environments": "environment",
    "register_tools": "tool",
    "register_rewards": "reward",
    "register_advantage_estimators": "advantage_estimator",
    "register_prompt_filters": "prompt_filter",
    "register_agents": "agent",
}
