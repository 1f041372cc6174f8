"""Fork reconciliation: turn a rollout's sampling requests into training sequences.

Every turn re-renders the whole conversation with the chat template, and some templates
render history differently once a message is appended (Qwen3 drops earlier `<think>` blocks).
So a turn's prompt either *extends* the tokens already held (clean append: same sequence) or
*rewrites* some of them (fork: a new sequence that starts with the turn's full prompt and
therefore shares the common prefix with the previous one, which tree packing exploits).

Design decision: one pure function over the shared types, no tokenizer and no torch. Generated
tokens are trained exactly once, in the sequence that was current when they were sampled; a
forked sequence repeats earlier generated tokens only as context (mask 0), so forks add
forward-pass tokens but never extra training signal. Sampler log-probs, top-k dictionaries
and sampling masks travel with their generated tokens; context positions get placeholders
(0.0 / None). `TurnRecord.output_mask` decides which generated tokens are trained; a turn that
trains tokens without `output_log_probs` is refused (the spec makes them required then).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from grpo_agent.top_logprobs import TopLogprobs
from grpo_agent.types import TrainingSequence, TurnRecord


@dataclass
class ReconcileStats:
    """How a rollout's turns were stitched together (feeds `rollout/fork_frac`, `drift_tokens_*`).

    `drift_tokens` has one entry per transition between consecutive turns: the number of held
    tokens the next prompt re-rendered (0 for a clean append).
    """

    num_transitions: int = 0
    num_forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)

    @property
    def fork_frac(self) -> float:
        """Fraction of transitions that started a new sequence (NaN without transitions)."""
        return self.num_forks / self.num_transitions if self.num_transitions else float("nan")


@dataclass
class _Builder:
    """A training sequence under construction; optional per-token columns start lazily."""

    token_ids: list[int] = field(default_factory=list)
    trained_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] | None = None
    sampling_mask: list[list[int] | None] | None = None

    def add_context(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        self.trained_mask.extend([0] * len(token_ids))
        self.sampler_logprobs.extend([0.0] * len(token_ids))
        if self.top_logprobs is not None:
            self.top_logprobs.extend([None] * len(token_ids))
        if self.sampling_mask is not None:
            self.sampling_mask.extend([None] * len(token_ids))

    def add_output(self, turn: TurnRecord) -> None:
        n = len(turn.output_ids)
        self.token_ids.extend(turn.output_ids)
        self.trained_mask.extend(turn.output_mask if turn.output_mask is not None else [1] * n)
        self.sampler_logprobs.extend(turn.output_log_probs or [0.0] * n)  # empty: none trained
        self.top_logprobs = _extend_column(
            self.top_logprobs, turn.output_sampler_logprobs, len(self.token_ids) - n, n
        )
        self.sampling_mask = _extend_column(
            self.sampling_mask, turn.output_sampling_mask, len(self.token_ids) - n, n
        )

    def build(self) -> TrainingSequence:
        return TrainingSequence(
            token_ids=self.token_ids,
            trained_mask=self.trained_mask,
            sampler_logprobs=self.sampler_logprobs,
            # Arrays, not a dict per token: cheaper to queue and to pack (top_logprobs.py).
            sampler_top_logprobs=None if self.top_logprobs is None
            else TopLogprobs.from_dicts(self.top_logprobs),
            sampling_mask=self.sampling_mask,
        )


def _extend_column(column: list | None, values: list | None, held: int, n: int) -> list | None:
    """Append a turn's per-token values, back-filling placeholders when a column starts late."""
    if values is None:
        return None if column is None else column + [None] * n
    if column is None:
        column = [None] * held
    return column + list(values)


def _check_turn(index: int, turn: TurnRecord) -> None:
    """Reject turns whose per-token columns do not line up with their output tokens."""
    n = len(turn.output_ids)
    columns = {
        "output_log_probs": turn.output_log_probs or None,
        "output_mask": turn.output_mask,
        "output_sampler_logprobs": turn.output_sampler_logprobs,
        "output_sampling_mask": turn.output_sampling_mask,
    }
    for name, values in columns.items():
        if values is not None and len(values) != n:
            raise ValueError(
                f"turn {index}: {name} has {len(values)} entries but output_ids has {n}; "
                "every per-token column must have one entry per generated token."
            )
    trained = n if turn.output_mask is None else sum(turn.output_mask)
    if trained and not turn.output_log_probs:
        raise ValueError(
            f"turn {index}: output_log_probs is empty but {trained} of its {n} output tokens are "
            "trained; the loss needs the sampler's log-prob of every trained token. Return the "
            "TurnRecord that generate_one_turn gives (it carries them), fill output_log_probs, "
            "or set output_mask to 0 for tokens that are context only."
        )


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Number of leading tokens `a` and `b` share."""
    limit = min(len(a), len(b))
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


def reconcile_turns(turns: list[TurnRecord]) -> tuple[list[TrainingSequence], ReconcileStats]:
    """Stitch a rollout's turns into training sequences (see the module docstring).

    Sequences that would train no token (every output masked out) are dropped, so a rollout
    can yield zero sequences (`rollout/samples_per_rollout` below 1).
    """
    stats = ReconcileStats()
    finished: list[_Builder] = []
    current: _Builder | None = None
    for index, turn in enumerate(turns):
        _check_turn(index, turn)
        if current is None:
            current = _Builder()
            current.add_context(turn.prompt_ids)
        else:
            held = current.token_ids
            shared = common_prefix_length(held, turn.prompt_ids)
            stats.num_transitions += 1
            if shared == len(held):
                stats.drift_tokens.append(0)
                current.add_context(turn.prompt_ids[shared:])
            else:
                stats.num_forks += 1
                stats.drift_tokens.append(len(held) - shared)
                finished.append(current)
                current = _Builder()
                current.add_context(turn.prompt_ids)
        current.add_output(turn)
    if current is not None:
        finished.append(current)
    sequences = [builder.build() for builder in finished]
    return [seq for seq in sequences if seq.num_trained > 0], stats
