"""Tree attention split by depth: flash calls on the row's own keys, merged by log-sum-exp.

Design decision: a query sees its own segment (causally) and every ancestor segment (whole).
So the tree's attention is a sum of parts that need no gathered copies of the keys:
- "self": every segment attends to itself causally, one varlen call over the row as it lies;
- one part per depth d: the descendants of each depth-d segment (in the depth-first layout a
  contiguous range right after it) attend to that segment's tokens, non-causally. Within one
  depth the segments and their descendant ranges are disjoint, so it is one varlen call on the
  selected query and key rows (each row selected at most once: a copy, never a duplicate).
Each part returns its outputs and log-sum-exps; out = sum_p exp(lse_p - L) out_p with
L = logsumexp_p(lse_p). For the backward, a flash kernel given the *merged* out and L
recomputes exactly the full softmax's probabilities and row terms, so each part's backward
returns its share of the exact gradient (the rule ring attention uses for blocks of keys).

Against gathering every segment's path (`varlen_attention`), a prompt shared by G completions
is read once per depth instead of G times, and its gradients need no scatter-add of G copies.
The work is exactly the tree's visible (query, key) pairs; the cost is one extra varlen call
per tree depth (two in a prompt -> completions row).

The forward and backward are custom ops: opaque to torch.compile (no graph break, no
recompile for a new row shape), and the plan's loop over depths runs inside them.
Kernels: PyTorch's own flash build (CUDA, half precision) or `reference`, the same contract
in plain tensor math (any device and dtype; the tests' oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_agent.train.packing import PackedRow

KERNELS = ("flash", "reference")


@dataclass
class LevelPlan:
    """Self part: segment bounds. Depth parts: selected query/key rows and their bounds."""

    kernel: str  # one of KERNELS
    self_cu: torch.Tensor  # int32 [S+1] segment bounds (queries and keys alike)
    self_max: int
    query_index: list[torch.Tensor]  # per depth: rows of the descendants, range by range
    key_index: list[torch.Tensor]  # per depth: rows of the depth's segments that have some
    cu_q: list[torch.Tensor]  # per depth: int32 bounds in query_index
    cu_k: list[torch.Tensor]  # per depth: int32 bounds in key_index
    max_lens: list[int]  # per depth: max_q, max_k (flattened pairs)

    @classmethod
    def build(cls, row: PackedRow, device, kernel: str) -> LevelPlan:
        if kernel not in KERNELS:
            raise ValueError(f"level attention kernel {kernel!r}: choose one of {KERNELS}")
        _, lens = torch.unique_consecutive(row.segment_ids, return_counts=True)
        ends = lens.cumsum(0).tolist()
        starts = [e - n for e, n in zip(ends, lens.tolist())]
        ancestors = row.segment_ancestors
        depth = (ancestors.sum(1) - 1).tolist()
        # a segment's subtree ends where its last descendant (or itself) ends
        subtree_end = torch.where(ancestors, torch.tensor(ends)[:, None], 0).amax(0).tolist()
        plan = cls(kernel, _bounds(lens.tolist(), device), int(lens.max()), [], [], [], [], [])
        for d in range(max(depth)):  # the deepest segments have no descendants
            pairs = [
                (range(ends[s], subtree_end[s]), range(starts[s], ends[s]))
                for s in range(len(ends))
                if depth[s] == d and subtree_end[s] > ends[s]
            ]
            q_lens, k_lens = [len(q) for q, _ in pairs], [len(k) for _, k in pairs]
            plan.query_index.append(torch.tensor([i for q, _ in pairs for i in q], device=device))
            plan.key_index.append(torch.tensor([i for _, k in pairs for i in k], device=device))
            plan.cu_q.append(_bounds(q_lens, device))
            plan.cu_k.append(_bounds(k_lens, device))
            plan.max_lens += [max(q_lens), max(k_lens)]
        return plan


def _bounds(lengths: list[int], device) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device, torch.int32)


def level_tree_attention(query, key, value, plan: LevelPlan, scaling) -> torch.Tensor:
    """Tree attention; inputs [1, heads, N, dim], output [1, N, heads, dim]."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, dim] views
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out, _ = torch.ops.grpo_agent.level_attention(
        q, k, v, plan.self_cu, plan.self_max, plan.query_index, plan.key_index, plan.cu_q,
        plan.cu_k, plan.max_lens, float(scaling), plan.kernel,
    )
    return out[None]


# --- kernels: (out, lse [rows, heads] float32) forward; (dq, dk, dv) backward from given out/lse


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out, _lse_rows(lse, q.shape[0], q.shape[1])


def _lse_rows(lse: torch.Tensor, rows: int, heads: int) -> torch.Tensor:
    """The varlen kernels' log-sum-exp is [heads, rows]."""
    if lse.shape != (heads, rows):
        raise RuntimeError(
            f"flash kernel returned a log-sum-exp of shape {tuple(lse.shape)}, expected "
            f"{(heads, rows)}: this torch build's flash layout is not supported by level "
            "attention; use tree attention backend 'varlen' or 'flex'."
        )
    return lse.t()


_NO_RNG = {}


def _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    key = q.device
    if key not in _NO_RNG:  # dropout is 0: the kernel never reads its random-state tensors
        _NO_RNG[key] = torch.empty(2, dtype=torch.uint64, device=q.device)
    rng = _NO_RNG[key]
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.t().contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, rng,
        scale=scale,
    )


def _reference_scores(q, k, cu_q, cu_k, causal, scale):
    """Per sequence: (query rows, key rows, scores [heads, q, k] in float32+, -inf masked)."""
    work = _work_dtype(q)
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                              cu_k[1:].tolist()):
        qs, ks = q[q0:q1].to(work), k[k0:k1].to(work).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:  # aligned bottom-right
            keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device)
            scores = scores.masked_fill(~keep.tril((k1 - k0) - (q1 - q0)), float("-inf"))
        yield slice(q0, q1), slice(k0, k1), scores


def _reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=_work_dtype(q), device=q.device)
    for qs, ks, scores in _reference_scores(q, k, cu_q, cu_k, causal, scale):
        lse[qs] = scores.logsumexp(-1).t()
        vs = v[ks].to(scores.dtype).repeat_interleave(group, 1)
        out[qs] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).to(q.dtype)
    return out, lse


def _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros_like(t, dtype=lse.dtype) for t in (q, k, v))
    for qs, ks, scores in _reference_scores(q, k, cu_q, cu_k, causal, scale):
        work = scores.dtype
        probs = torch.exp(scores - lse[qs].t()[..., None])
        do, o = dout[qs].to(work), out[qs].to(work)
        kk, vv = (t[ks].to(work).repeat_interleave(group, 1) for t in (k, v))
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        ds = probs * (dp - (do * o).sum(-1).t()[..., None])
        dq[qs] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        heads_k = k.shape[1]
        dk[ks] = (torch.einsum("hqk,qhd->khd", ds, q[qs].to(work)) * scale).unflatten(
            1, (heads_k, group)).sum(2)
        dv[ks] = torch.einsum("hqk,qhd->khd", probs, do).unflatten(1, (heads_k, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_FORWARD = {"flash": _flash_forward, "reference": _reference_forward}
_BACKWARD = {"flash": _flash_backward, "reference": _reference_backward}


# --- the custom ops


@torch.library.custom_op("grpo_agent::level_attention", mutates_args=())
def _level_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, self_cu: torch.Tensor, self_max: int,
    query_index: list[torch.Tensor], key_index: list[torch.Tensor], cu_q: list[torch.Tensor],
    cu_k: list[torch.Tensor], max_lens: list[int], scale: float, kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged output [N, heads, dim] and log-sum-exp [N, heads] (float32) of all parts."""
    forward = _FORWARD[kernel]
    out, lse = forward(q, k, v, self_cu, self_cu, self_max, self_max, True, scale)
    work = _work_dtype(q)
    if not query_index:
        return out, lse.to(work).contiguous()
    merged, total = out.to(work), lse.to(work).contiguous()
    for d, (qi, ki) in enumerate(zip(query_index, key_index)):
        part, part_lse = forward(
            q.index_select(0, qi), k.index_select(0, ki), v.index_select(0, ki), cu_q[d],
            cu_k[d], max_lens[2 * d], max_lens[2 * d + 1], False, scale,
        )
        before = total.index_select(0, qi)
        after = torch.logaddexp(before, part_lse.to(work))
        merged.index_copy_(0, qi, merged.index_select(0, qi) * (before - after).exp()[..., None]
                           + part.to(work) * (part_lse - after).exp()[..., None])
        total.index_copy_(0, qi, after)
    return merged.to(q.dtype), total


@_level_attention.register_fake
def _(q, k, v, self_cu, self_max, query_index, key_index, cu_q, cu_k, max_lens, scale, kernel):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=_work_dtype(q))


def _work_dtype(q: torch.Tensor) -> torch.dtype:
    """Merging and gradient sums run in float32 (float64 stays float64)."""
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.custom_op("grpo_agent::level_attention_backward", mutates_args=())
def _level_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, self_cu: torch.Tensor, self_max: int, query_index: list[torch.Tensor],
    key_index: list[torch.Tensor], cu_q: list[torch.Tensor], cu_k: list[torch.Tensor],
    max_lens: list[int], scale: float, kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every part's backward from the merged out and log-sum-exp; shares summed in float32."""
    backward = _BACKWARD[kernel]
    grads = backward(dout, q, k, v, out, lse, self_cu, self_cu, self_max, self_max, True, scale)
    if not query_index:
        return tuple(g.contiguous() for g in grads)
    work = _work_dtype(q)
    dq, dk, dv = (g.to(work) for g in grads)
    for d, (qi, ki) in enumerate(zip(query_index, key_index)):
        part_dq, part_dk, part_dv = backward(
            dout.index_select(0, qi), q.index_select(0, qi), k.index_select(0, ki),
            v.index_select(0, ki), out.index_select(0, qi), lse.index_select(0, qi), cu_q[d],
            cu_k[d], max_lens[2 * d], max_lens[2 * d + 1], False, scale,
        )
        dq.index_add_(0, qi, part_dq.to(work))  # rows are distinct within a depth: no races
        dk.index_add_(0, ki, part_dk.to(work))
        dv.index_add_(0, ki, part_dv.to(work))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_level_attention_backward.register_fake
def _(dout, q, k, v, out, lse, self_cu, self_max, query_index, key_index, cu_q, cu_k, max_lens,
      scale, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *plan = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.plan = plan


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    grads = torch.ops.grpo_agent.level_attention_backward(
        dout.contiguous(), q, k, v, out, lse, *ctx.plan
    )
    self_cu, self_max, *index_lists, max_lens, scale, kernel = ctx.plan
    # the plan has no gradient; each list of tensors takes a list of Nones
    return *grads, None, None, *([None] * len(x) for x in index_lists), None, None, None


_level_attention.register_autograd(_backward, setup_context=_setup_context)
