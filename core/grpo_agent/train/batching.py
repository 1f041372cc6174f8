"""Step planning: which samples go into which packed row of which micro-batch.

Design decision: a step is `grad_accum_steps` micro-batches of `num_processes` rows, each row
holding at most `token_budget` UNIQUE tokens (shared prefixes count once). Samples arrive one
at a time (`StepPlanner.add`), so the trainer can pull from the rollout queue until the plan
says the step is full. Placement follows the spec:

1. a sample goes to the row that already holds its group (its prompt is there already);
2. a sample of a new group goes to the row where it is cheapest, which spreads groups over
   processes while rows are empty;
3. when its group's row is full, it goes to another row if some process still has an empty
   row, or if that does not raise the cost of the most expensive row (which sets the
   micro-batch's time); otherwise the micro-batch is closed and the next one opened.

Cost is attention cost: the number of keys every forwarded token attends to, sum(depth + 1)
(L(L+1)/2 for an unshared sample: the squared length). Samples longer than the budget are
dropped with a warning and counted (`batch/dropped_oversize_count`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from grpo_agent.train.packing import PackedRow, PrefixTrie, pack_row, predicts_trained
from grpo_agent.types import TrainingSample

logger = logging.getLogger(__name__)


@dataclass
class _RowBuilder:
    trie: PrefixTrie = field(default_factory=PrefixTrie)
    samples: list[TrainingSample] = field(default_factory=list)
    groups: set[int] = field(default_factory=set)

    @property
    def tokens(self) -> int:
        return self.trie.num_nodes

    @property
    def cost(self) -> int:
        return self.trie.attention_cost

    def preview(self, sample: TrainingSample) -> tuple[int, int]:
        return self.trie.added_tokens(sample.sequence.token_ids, predicts_trained(sample))

    def add(self, sample: TrainingSample) -> None:
        self.trie.insert(sample.sequence.token_ids, predicts_trained(sample))
        self.samples.append(sample)
        self.groups.add(sample.group_id)


@dataclass
class StepPlan:
    """`microbatches[i][process]` is the row that process forwards in micro-batch i."""

    microbatches: list[list[PackedRow]]
    metrics: dict[str, float]
    dropped: list[TrainingSample]  # longer than token_budget
    leftover: list[TrainingSample]  # did not fit this step: put them first in the next one

    def trained_tokens(self, microbatch: int) -> int:
        """Trained tokens of one micro-batch over all processes (the loss normaliser)."""
        return sum(row.num_trained for row in self.microbatches[microbatch])

    @property
    def samples(self) -> int:
        return sum(row.num_samples for mb in self.microbatches for row in mb)


def trained_only(samples: list[TrainingSample], dropped: list[TrainingSample]) -> list[TrainingSample]:
    """A step's `samples` (in order) but the planner's `dropped` ones: their prompts are
    consumed, so the ledger records them, but their tokens are not trained. Matched by identity:
    FSDP ranks receive the plan and the samples in one broadcast (`_share_step_plan`), whose
    pickle keeps them the same objects."""
    gone = {id(sample) for sample in dropped}
    return [sample for sample in samples if id(sample) not in gone]


class StepPlanner:
    """Fill one step incrementally; `add` returns False once the step is full."""

    def __init__(self, *, token_budget: int, num_processes: int, grad_accum_steps: int) -> None:
        if token_budget < 1 or num_processes < 1 or grad_accum_steps < 1:
            raise ValueError(
                f"token_budget={token_budget}, num_processes={num_processes} and "
                f"grad_accum_steps={grad_accum_steps} must all be >= 1."
            )
        self.token_budget = token_budget
        self.num_processes = num_processes
        self.grad_accum_steps = grad_accum_steps
        self._microbatches = [self._empty_microbatch()]
        self.dropped: list[TrainingSample] = []
        self.full = False

    def _empty_microbatch(self) -> list[_RowBuilder]:
        return [_RowBuilder() for _ in range(self.num_processes)]

    def add(self, sample: TrainingSample) -> bool:
        """Place a sample; True when it was consumed (placed, or dropped as oversize)."""
        if sample.num_tokens > self.token_budget:
            if not self.dropped:  # once per step: the rest are counted in batch/dropped_oversize_count
                logger.warning(
                    "Dropping a sample of %d tokens: longer than token_budget=%d (this step's "
                    "others are counted in batch/dropped_oversize_count). Raise token_budget (and "
                    "the server's --max-model-len) or shorten rollouts (max_completion_length, "
                    "max_tool_calling_iterations).",
                    sample.num_tokens,
                    self.token_budget,
                )
            self.dropped.append(sample)
            return True
        if self.full:
            return False
        while (row := self._choose_row(sample, self._microbatches[-1])) is None:
            if len(self._microbatches) == self.grad_accum_steps:
                self.full = True
                return False
            self._microbatches.append(self._empty_microbatch())
        row.add(sample)
        return True

    def _choose_row(self, sample: TrainingSample, rows: list[_RowBuilder]) -> _RowBuilder | None:
        added = {id(r): r.preview(sample) for r in rows}
        fits = [r for r in rows if r.tokens + added[id(r)][0] <= self.token_budget]
        homes = [r for r in rows if sample.group_id in r.groups]
        home = next((r for r in homes if r in fits), None)
        if home is not None:
            return home
        if not fits:
            return None
        cheapest = min(fits, key=lambda r: r.cost + added[id(r)][1])
        if not homes:
            return cheapest
        empty = next((r for r in fits if not r.samples), None)
        if empty is not None:
            return empty
        max_cost = max(r.cost for r in rows)
        return cheapest if cheapest.cost + added[id(cheapest)][1] <= max_cost else None

    def plan(self, leftover: list[TrainingSample] | None = None) -> StepPlan:
        used = [mb for mb in self._microbatches if any(r.samples for r in mb)]
        microbatches = [[pack_row(r.samples, r.trie) for r in mb] for mb in used]
        metrics = step_metrics(microbatches, self.token_budget, len(self.dropped))
        return StepPlan(microbatches, metrics, list(self.dropped), list(leftover or []))


def plan_step(
    samples: list[TrainingSample], *, token_budget: int, num_processes: int, grad_accum_steps: int
) -> StepPlan:
    """Plan one step from a list of samples (grouped by group first, in arrival order)."""
    planner = StepPlanner(
        token_budget=token_budget, num_processes=num_processes, grad_accum_steps=grad_accum_steps
    )
    ordered = _grouped(samples)
    for i, sample in enumerate(ordered):
        if not planner.add(sample):
            return planner.plan(leftover=ordered[i:])
    return planner.plan()


def _grouped(samples: list[TrainingSample]) -> list[TrainingSample]:
    first_seen: dict[int, int] = {}
    for i, s in enumerate(samples):
        first_seen.setdefault(s.group_id, i)
    return sorted(samples, key=lambda s: first_seen[s.group_id])


def attention_cost(row: PackedRow) -> int:
    return int((row.position_ids + 1).sum())


def step_metrics(
    microbatches: list[list[PackedRow]], token_budget: int, dropped: int
) -> dict[str, float]:
    """The spec's batch/* metrics for one step."""
    rows = [r for mb in microbatches for r in mb]
    filled = [r for r in rows if not r.is_empty] or rows
    forwarded = sum(r.num_tokens for r in rows)
    trained = sum(r.num_trained for r in rows)
    groups = {g for r in rows for g in r.group_ids}
    pad = sum(
        max(r.num_tokens for r in mb) * len(mb) - sum(r.num_tokens for r in mb)
        for mb in microbatches
    )
    padded = sum(max(r.num_tokens for r in mb) * len(mb) for mb in microbatches)
    return {
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": float(trained),
        "batch/samples_per_step": float(sum(r.num_samples for r in rows)),
        "batch/groups_per_step": float(len(groups)),
        "batch/microbatches_per_step": float(len(microbatches)),
        "batch/masked_token_frac": (forwarded - trained) / forwarded if forwarded else 0.0,
        "batch/samples_per_row": _mean([r.num_samples for r in filled]),
        "batch/row_tokens_mean": _mean([r.num_tokens for r in filled]),
        "batch/row_tokens_max": float(max((r.num_tokens for r in rows), default=0)),
        "batch/row_fill_frac": _mean([r.num_tokens / token_budget for r in rows]),
        "batch/row_imbalance": _mean([_imbalance(mb) for mb in microbatches]),
        "batch/packing_ratio": sum(r.unpacked_tokens for r in rows) / forwarded
        if forwarded
        else 1.0,
        "batch/pad_frac": pad / padded if padded else 0.0,
        "batch/dropped_oversize_count": float(dropped),
    }


def _imbalance(rows: list[PackedRow]) -> float:
    costs = [attention_cost(r) for r in rows]
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean else 1.0


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
