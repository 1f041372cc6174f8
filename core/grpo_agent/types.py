"""Shared data types that flow one way: rollout worker -> sample queue -> batcher -> loss.

Plain dataclasses with no torch import, so the rollout side (a spawned CPU process) and the
pure functions (fork reconciliation, tree packing) can use them without loading the trainer.
`TurnRecord`, `Rollout` and `RolloutGroup` carry the fields of the spec's public API.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, Any]]


@dataclass
class TurnRecord:
    """One sampling request: the full prompt sent to the sampler and what it generated."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    # 1 = train on this output token, 0 = keep as context only. None = train on all.
    output_mask: list[int] | None = None
    # Per output token: the token ids the sampler could draw from under top-k/top-p/min-p.
    # None = the full vocabulary.
    output_sampling_mask: list[list[int]] | None = None
    # Per output token: the sampler's log-probs of its most likely tokens (score centering).
    output_sampler_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    # Per output token: the weight version the server sampled it with (when it reports it).
    weight_versions: list[str] | None = None


def _new_rollout_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Rollout:
    """One finished rollout returned by `AsyncRolloutLoop.generate_one`."""

    completion: Messages
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=_new_rollout_id)
    # Per-rollout metric observations (tools/*, env/*) that the loop aggregates.
    metrics: dict[str, list[float]] = field(default_factory=dict)
    # The model calls of a run its loop dropped (a failed agent run: `turns` empty, reward NaN):
    # never trained, kept so an evaluation can check which weights sampled them.
    dropped_turns: list[TurnRecord] = field(default_factory=list)


@dataclass
class TrainingSequence:
    """A token sequence built from a rollout's turns (fork reconciliation output).

    Every generated token of a rollout is trained in exactly one sequence; prompt and tool
    tokens are context (`trained_mask` 0). Per-token lists all have `len(token_ids)` entries;
    sampler values at untrained positions are placeholders (0.0 / None).
    """

    token_ids: list[int]
    trained_mask: list[int]
    sampler_logprobs: list[float]
    # A `grpo_agent.top_logprobs.TopLogprobs` from the rollout side (arrays, compact in the queue);
    # a list of dicts is accepted too.
    sampler_top_logprobs: Any = None
    sampling_mask: list[list[int] | None] | None = None

    @property
    def num_trained(self) -> int:
        return sum(self.trained_mask)


@dataclass
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, scored together."""

    prompts: list[Messages]
    reward_kwargs: dict[str, list[Any]]
    completions: list[Messages]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: Any = None  # np.ndarray of summed rewards (NaN = unscored), set before advantages
    rollouts: list[Rollout] = field(default_factory=list)
    # Position of the prompt in the worker's prompt stream (see `TrainingSample.prompt_index`).
    prompt_index: int = 0


@dataclass
class TrainingSample:
    """What the trainer pulls from the rollout queue: one sequence plus its provenance."""

    sequence: TrainingSequence
    advantage: float
    model_version: int
    group_id: int
    row_index: int
    # Position of the prompt in the worker's prompt stream (epoch * len(dataset) + position in
    # that epoch's shuffled order): resume restarts from the first position not yet trained.
    prompt_index: int = 0
    # How many samples this prompt's kept group produced, so the trainer knows when a prompt
    # is fully trained.
    group_num_samples: int = 1
    rollout_id: str = ""
    queued_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.sequence.token_ids)


@dataclass
class PromptConsumed:
    """Worker -> trainer notice that a prompt was consumed without producing samples.

    Sent for filtered prompts and dropped groups (zero reward std, failed reward), so the resume
    position can move past them. Travels on the same queue as `TrainingSample`s.
    """

    prompt_index: int
    row_index: int
    reason: str
