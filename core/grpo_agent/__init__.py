"""grpo-agent: asynchronous GRPO for LLM agents.

The public API is imported lazily so that `grpo-agent --help` and plugin imports stay fast
(torch and transformers load only when a trainer or config is touched).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from grpo_agent._version import __version__

_LAZY = {
    "AsyncGRPOConfig": "grpo_agent.config",
    "AsyncGRPOTrainer": "grpo_agent.train.trainer",
    "HarnessAsyncGRPOTrainer": "grpo_agent.train.harness_trainer",
    "AgentCommand": "grpo_agent.rollout.agent_programs",
    "agent": "grpo_agent.plugins.decorators",
    "AsyncRolloutLoop": "grpo_agent.rollout.loop",
    "Rollout": "grpo_agent.types",
    "TurnRecord": "grpo_agent.types",
    "RolloutGroup": "grpo_agent.types",
    "TrainingSequence": "grpo_agent.types",
    "hookimpl": "grpo_agent.plugins.hookspecs",
    "environment": "grpo_agent.plugins.decorators",
    "tool": "grpo_agent.plugins.decorators",
    "reward": "grpo_agent.plugins.decorators",
    "advantage_estimator": "grpo_agent.plugins.decorators",
    "prompt_filter": "grpo_agent.plugins.decorators",
    "Option": "grpo_agent.plugins.options",
    "load_environment": "grpo_agent.plugins.manager",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from grpo_agent.config import AsyncGRPOConfig
    from grpo_agent.plugins.decorators import (
        advantage_estimator,
        agent,
        environment,
        prompt_filter,
        reward,
        tool,
    )
    from grpo_agent.plugins.hookspecs import hookimpl
    from grpo_agent.plugins.manager import load_environment
    from grpo_agent.plugins.options import Option
    from grpo_agent.rollout.agent_programs import AgentCommand
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.train.harness_trainer import HarnessAsyncGRPOTrainer
    from grpo_agent.train.trainer import AsyncGRPOTrainer
    from grpo_agent.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo_agent' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
