"""The one interface the trainer pushes through, and the choice of pusher at train start.

Two modes, chosen once from what the server reports: every weight with LoRA merged in
(`full.WeightPusher`, any server) or, for a PEFT model on a server started with
`--enable-lora`, the adapter alone (`adapter.AdapterPusher`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.rollout.allowance import holds_before_push
from grpo_agent.sampler.server_facts import ServerFacts
from grpo_agent.train.weights import served_weights_may_differ
from grpo_agent.weight_sync.adapter import AdapterPusher, use_adapter_sync
from grpo_agent.weight_sync.full import WeightPusher


class Pusher(Protocol):
    """Makes the trainer's current policy the server's model version N."""

    lora_name: str | None  # the served adapter prefix rollouts sample, None: the base model
    last_num_bytes: int  # what the last push moved
    on_served: Callable[[int], None]  # called with each version once the server serves it

    def needs_initial_push(self, model: nn.Module, holds_pushed_weights: bool) -> bool:
        """Whether version 0 must be pushed before the first rollout."""

    def push(self, model: nn.Module, version: int) -> dict[str, float]:
        """Push the policy as `version` (every rank calls it); returns perf/weight_sync_* timings.
        It may return while the push still runs (`full.WeightPusher`'s background sends)."""

    def wait(self) -> dict[str, float]:
        """Until every push has landed: the timings of one that ended since, or its error."""

    def close(self) -> None: ...


def build_weight_pusher(args: AsyncGRPOConfig, model: nn.Module, facts: ServerFacts) -> Pusher:
    """An `AdapterPusher` when the server can serve this model's LoRA adapter, else merged;
    raises when a LoRA server's limits are too small."""
    if use_adapter_sync(model, facts, args):
        return AdapterPusher(args, model,
                             base_is_stale=served_weights_may_differ(model, facts.holds_pushed_weights),
                             backend=facts.weight_transfer_backend)
    # Under a max_staleness=0 hold nothing samples until the push lands: nothing to overlap.
    return WeightPusher(args, backend=facts.weight_transfer_backend,
                        background=not holds_before_push(args.max_staleness))
