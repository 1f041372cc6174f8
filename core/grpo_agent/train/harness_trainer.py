"""`HarnessAsyncGRPOTrainer`: train any agent program that speaks the OpenAI API.

Design decision: this is `AsyncGRPOTrainer` with one change, its rollout loop: the worker
serves a token-faithful gateway (`grpo_agent.rollout.gateway`) and runs the agent once per
rollout against it. Groups, staleness, packing, weight sync, metrics and checkpoints are the
parent's. The agent is resolved here once (to fail before any process starts) and sent to the
spawned worker by reference, so it must be importable there: a module-level async function,
a registered name, `pkg.mod:attr`, or an `AgentCommand`.
"""
from __future__ import annotations

import functools
from typing import Any

from grpo_agent.plugins import check_picklable
from grpo_agent.plugins.pickling import refuse_trainer_in_spawned_import
from grpo_agent.rollout.agent_programs import AgentCommand, resolve_agent
from grpo_agent.rollout.gateway import HarnessLimits
from grpo_agent.rollout.harness import HarnessRolloutLoop
from grpo_agent.train.trainer import AsyncGRPOTrainer


class HarnessAsyncGRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` whose rollouts are runs of `agent` (see the module docstring).

    `agent`: `async def run(client: openai.AsyncOpenAI, row: dict) -> float | None`, a name
    registered through `register_agents`, `"pkg.mod:attr"`, or `AgentCommand("python a.py")`.
    The agent's float is the rollout's reward; None leaves scoring to `reward_funcs`.
    Limits per rollout: `agent_timeout_s` (wall time), `agent_max_calls` (model calls),
    `agent_max_tokens` (generated tokens); `gateway_host` is loopback unless you open it.
    `agent_max_commands`: command agents running at once (default max(4, CPU count)); each is
    a sandboxed process tree, while the rollout cap (`max_concurrent_rollouts`) is in the hundreds.
    `eval_dataset` rows run the same agent through an evaluation's own gateway with the eval
    sampling settings (`train/evaluation.py`); they never reach training.
    """

    def __init__(self, model: Any, agent: Any, reward_funcs: Any = None, args: Any = None,
                 train_dataset: Any = None, *, agent_timeout_s: float = 600.0,
                 agent_max_calls: int | None = 64, agent_max_tokens: int | None = None,
                 agent_max_commands: int | None = None,
                 gateway_host: str = "127.0.0.1", gateway_port: int = 0, **kwargs: Any) -> None:
        refuse_trainer_in_spawned_import(type(self).__name__)  # before the agent's pickling check
        if kwargs.get("tools") or kwargs.get("environment_factory"):
            raise ValueError("HarnessAsyncGRPOTrainer runs your agent program, which owns its tools "
                             "and environment: drop tools=/environment_factory=, or use "
                             "AsyncGRPOTrainer for the built-in tool loop.")
        resolve_agent(agent)  # fail now, naming the problem, not in the spawned worker
        if not isinstance(agent, (str, AgentCommand)):
            check_picklable({"agent": agent})
        super().__init__(model=model, reward_funcs=reward_funcs, args=args,
                         train_dataset=train_dataset, **kwargs)
        limits = HarnessLimits(timeout_s=agent_timeout_s, max_calls=agent_max_calls,
                               max_generated_tokens=agent_max_tokens, max_commands=agent_max_commands,
                               host=gateway_host, port=gateway_port)
        self.loop_cls = functools.partial(HarnessRolloutLoop, agent=agent, limits=limits)
