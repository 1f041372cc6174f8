"""How `level_attention` sums its parts: outputs by log-sum-exp, gradients by addition.

Design decision: the self part covers every row; a depth part covers a subset (the rows it
selects, each at most once). Two ways to add a subset's contribution:
- "float32" (the previous path): the self part's output, log-sum-exp and gradients are copied
  into float32 tensors of the whole row, every part is merged into those, and the sums are
  rounded to the compute dtype at the end. Each depth part re-copies the whole row
  (out-of-place index_copy / index_add), and the final casts read it again: on an H200 at 16k
  rows about half of the level path's attention time was such whole-row float32 traffic
  (docs/performance.md).
- "rows" (default): the self part's output and gradients stay in the compute dtype; a depth part
  reads its own rows, merges/adds in float32 and writes them back in place, rounded once. So the
  work is proportional to the selected rows, and nothing of the whole row is copied.
For a tree two levels deep (a prompt and its completions: the trainer's usual rows) every row
is in at most one depth part, so both give the same numbers bit for bit (one float32 sum,
rounded once). A row in k depth parts is rounded k times under "rows" instead of once: still
within the compute dtype's tolerance, which the GPU tests hold against the float32 reference.
"""

from __future__ import annotations

import torch

from grpo_agent.train.compiled_or_eager import CompiledOrEager

MERGE = "rows"  # read when a LevelPlan is built (bench/mfu.py --merges picks the old path)
MERGES = ("rows", "float32")


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """Merging and gradient sums run in float32 (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def check(mode: str) -> str:
    if mode not in MERGES:
        raise ValueError(f"level attention merge {mode!r}: choose one of {MERGES}")
    return mode


class OutputMerge:
    """Adds parts' (rows, out, lse) into one output."""

    def __init__(self, q: torch.Tensor, mode: str):
        self.mode, self.work = check(mode), work_dtype(q)
        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device
        self.out = self.lse = None

    def add(self, rows: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor) -> None:
        """`rows` None: the self part (every row in order), which comes first."""
        full = self.mode == "float32"
        if rows is None:  # the self part: the merge starts there
            self.out = out.to(self.work) if full else out
            self.lse = lse.to(self.work) if full else lse.to(self.work).contiguous()
            return
        if self.out is None:
            self.out = torch.zeros(self.shape, dtype=self.work if full else self.dtype,
                                   device=self.device)
            self.lse = torch.full(self.shape[:2], float("-inf"), dtype=self.work,
                                  device=self.device)
        mixed, after = merged_rows(self.out, self.lse, rows, out, lse)
        if full:
            self.out = self.out.index_copy(0, rows, mixed)
            self.lse = self.lse.index_copy(0, rows, after)
        else:  # in place, on tensors this merge owns (kernel outputs or its own zeros)
            self.out.index_copy_(0, rows, mixed)
            self.lse.index_copy_(0, rows, after)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in the compute dtype, lse in float32 or wider: what the backward is given)."""
        return self.out.to(self.dtype), self.lse


class GradSum:
    """Adds parts' gradients: (None, (dq, dk, dv)) for every row in order, or ((query rows,
    key rows), their grads)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, mode: str):
        self.mode, self.work = check(mode), work_dtype(q)
        self.like = (q, k, k)
        self.grads: list[torch.Tensor] | None = None

    def add(self, rows, grads) -> None:
        """`rows` None: the self part's gradients (every row in order), which come first."""
        full = self.mode == "float32"
        if rows is None:
            self.grads = [g.to(self.work) if full else g for g in grads]
            return
        if self.grads is None:  # the self part ran as padded batches: each adds its rows
            self.grads = [torch.zeros_like(x, dtype=self.work if full else x.dtype)
                          for x in self.like]
        for i, (total, g, at) in enumerate(zip(self.grads, grads, (rows[0], rows[1], rows[1]))):
            if full:
                self.grads[i] = total.index_add(0, at, g.to(self.work))
            else:  # rows are distinct within a part: gather, add in float32, write back
                total.index_copy_(0, at, summed_rows(total, at, g))

    def result(self) -> tuple[torch.Tensor, ...]:
        return tuple(g.to(x.dtype) for g, x in zip(self.grads, self.like))


# The element-wise work of one part, fused into a kernel or two on CUDA (`compiled_or_eager`):
# unfused, the merge and gradient sums were about 11% of the compiled 1.7B level step's GPU
# time at 16k rows (docs/performance.md).


def _merged_rows(out, lse, rows, part_out, part_lse):
    """A part's rows merged with what `out`/`lse` hold there: (out rows in out's dtype, lse)."""
    before = lse.index_select(0, rows)
    part_lse = part_lse.to(before.dtype)
    after = torch.logaddexp(before, part_lse)
    mixed = (out.index_select(0, rows).to(before.dtype) * (before - after).exp()[..., None]
             + part_out.to(before.dtype) * (part_lse - after).exp()[..., None])
    return mixed.to(out.dtype), after


def _summed_rows(total, at, grad):
    """total[at] + grad, added in float32 (or wider), in total's dtype."""
    work = work_dtype(total)
    return (total.index_select(0, at).to(work) + grad.to(work)).to(total.dtype)


merged_rows = CompiledOrEager(_merged_rows)
summed_rows = CompiledOrEager(_summed_rows)
