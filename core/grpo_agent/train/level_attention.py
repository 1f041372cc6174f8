"""Tree attention split by depth: flash calls on the row's own keys, merged by log-sum-exp.

Design decision: a query sees its own segment (causally) and every ancestor segment (whole).
So the tree's attention is a sum of parts that need no gathered copies of the keys:
- "self": every segment attends to itself causally, one varlen call over the row as it lies;
- one part per depth d: the descendants of each depth-d segment (in the depth-first layout a
  contiguous range right after it) attend to that segment's tokens, non-causally. Within one
  depth the segments and their descendant ranges are disjoint, so it is one varlen call on the
  selected query and key rows (each row selected at most once: a copy, never a duplicate).
Each part returns its outputs and log-sum-exps; out = sum_p exp(lse_p - L) out_p with
L = logsumexp_p(lse_p), summed on each part's own rows (`level_merge`). For the backward, a flash kernel given the *merged* out and L
recomputes exactly the full softmax's probabilities and row terms, so each part's backward
returns its share of the exact gradient (the rule ring attention uses for blocks of keys).

Against gathering every segment's path (`varlen_attention`), a prompt shared by G completions
is read once per depth instead of G times, its gradients need no scatter-add of G copies, and
backward saves the row's keys, not every path's. The work is exactly the tree's visible
(query, key) pairs; the cost is one more varlen call, with its index copies and merge, per
tree depth (two in a prompt -> completions row).

Measured on an H200 (docs/performance.md, 1.7B shape, 16k-token rows): its attention kernels
take 186 ms where varlen's take 279 (4 rows), and it needs 13-18% less peak memory; eager it is
2.8% faster, compiled 1.5-2% slower (the merge's element-wise work runs unfused inside the op,
about 160 ms and 7,400 more kernels). "auto" picks it for eager layers' rows of at least
`tree_attention.LEVELS_MIN_TOKENS`.

A part can also run as one padded dense batch on cuDNN's SDPA kernel (`cudnn_attention`,
`DENSE`): by default the depth parts, where every key range has one length (a group's prompt),
which on an H200 timed the (traced, see below) 1.7B step 1.7-3.4% faster at 15-16k rows; the self
part stays on flash (padding it too was slower: its gathers cost more than cuDNN saves).

Everything is tensor ops with no host synchronisation, wrapped in one custom op (and one
backward op) that compiled layers call whole: traced part by part as an autograd.Function,
the flash path's gradients were wrong on an H200 (`_level_attention`, docs/performance.md).
Kernels: PyTorch's own flash build (CUDA, half precision) or `reference`, the same contract
in dense masked tensor math (any device and dtype; the tests' oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_agent.train import cudnn_attention, flash_impl, level_merge
from grpo_agent.train.cudnn_attention import DensePart, padded
from grpo_agent.train.packing import PackedRow
from grpo_agent.train.transfer import to_device

KERNELS = ("flash", "reference")
# Padded dense parts (`cudnn_attention`): "off" keeps every part on the varlen kernel;
# "cudnn-depth" pads the depth parts onto cuDNN and keeps the self part on flash; "auto" is
# "cudnn-depth" where cuDNN's probe passes (flash plans only) and "off" while torch's flash
# ops run FlashAttention 4 (`flash_impl`: 0.460 -> 0.477 MFU, 1.7B, 16k rows, H100), which
# beats cuDNN on them; "cudnn"/"reference" pad every
# part (all-dense was slower than flash on an H200: docs/performance.md).
DENSE = "auto"
DENSE_CHOICES = ("auto", "off", "cudnn", "cudnn-depth", "reference")


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
    max_q: list[int]  # per depth: longest query range
    max_k: list[int]  # per depth: longest key range
    dense_kernel: str | None = None  # padded parts' kernel: "cudnn", "reference" or None
    self_dense: list[DensePart] | None = None  # the self part as padded batches
    depth_dense: list[DensePart | None] | None = None  # per depth: padded batch or varlen
    merge: str = "rows"  # how parts are summed: level_merge.MERGES

    @classmethod
    def build(cls, row: PackedRow, device, kernel: str, dense: str | None = None) -> LevelPlan:
        if kernel not in KERNELS:
            raise ValueError(f"level attention kernel {kernel!r}: choose one of {KERNELS}")
        dense = DENSE if dense is None else dense
        depth_only = dense in ("auto", "cudnn-depth")
        dense = _dense_kernel(kernel, torch.device(device), dense)
        segments, depths = tree_parts(row)
        lens = [len(r) for r in segments]
        (self_cu,) = to_device(device, _bounds(lens))
        plan = cls(kernel, self_cu, max(lens), [], [], [], [], [], [], dense,
                   merge=level_merge.check(level_merge.MERGE))
        if dense and not depth_only:
            plan.self_dense = cudnn_attention.self_parts(segments, device)
        plan.depth_dense = [] if dense else None
        for pairs in depths:
            q_lens, k_lens = [len(q) for q, _ in pairs], [len(k) for _, k in pairs]
            query_index, key_index, cu_q, cu_k = to_device(
                device,
                torch.tensor([i for q, _ in pairs for i in q]),
                torch.tensor([i for _, k in pairs for i in k]),
                _bounds(q_lens),
                _bounds(k_lens),
            )
            plan.query_index.append(query_index)
            plan.key_index.append(key_index)
            plan.cu_q.append(cu_q)
            plan.cu_k.append(cu_k)
            plan.max_q.append(max(q_lens))
            plan.max_k.append(max(k_lens))
            if dense:
                plan.depth_dense.append(cudnn_attention.depth_part(pairs, device))
        return plan

    def parts(self, dense: bool = True) -> tuple[tuple, list[torch.Tensor]]:
        """The parts as the level attention op takes them: one (kind, ints) each, tensors flat.
        `dense=False`: every part on the varlen kernel (a head size cuDNN was not seen with)."""
        layout, tensors = [], []
        if self.self_dense and dense:
            for part in self.self_dense:
                _add_dense(part, layout, tensors)
        else:
            layout.append(("self", (self.self_max,)))
            tensors.append(self.self_cu)
        depths = zip(self.query_index, self.key_index, self.cu_q, self.cu_k, self.max_q,
                     self.max_k, (dense and self.depth_dense) or [None] * len(self.max_q))
        for qi, ki, cu_q, cu_k, max_q, max_k, part in depths:
            if part is not None:
                _add_dense(part, layout, tensors)
            else:
                layout.append(("varlen", (max_q, max_k)))
                tensors += [qi, ki, cu_q, cu_k]
        return tuple(layout), tensors


def tree_parts(row: PackedRow) -> tuple[list[range], list[list[tuple[range, range]]]]:
    """The row's segments (row ranges, in order), and per depth d the (descendant rows,
    segment rows) pair of every depth-d segment that has descendants."""
    _, lens = torch.unique_consecutive(row.segment_ids, return_counts=True)
    ends = lens.cumsum(0).tolist()
    starts = [e - n for e, n in zip(ends, lens.tolist())]
    ancestors = row.segment_ancestors
    depth = (ancestors.sum(1) - 1).tolist()
    # a segment's subtree ends where its last descendant (or itself) ends
    subtree_end = torch.where(ancestors, torch.tensor(ends)[:, None], 0).amax(0).tolist()
    depths = [
        [(range(ends[s], subtree_end[s]), range(starts[s], ends[s]))
         for s in range(len(ends)) if depth[s] == d and subtree_end[s] > ends[s]]
        for d in range(max(depth))  # the deepest segments have no descendants
    ]
    return [range(a, b) for a, b in zip(starts, ends)], depths


def _add_dense(part: DensePart, layout: list, tensors: list) -> None:
    layout.append(("dense", (part.causal,)))
    tensors += [part.q_index, part.q_valid, part.k_index, part.rows_q, part.pos_q, part.rows_k,
                part.pos_k]


def _dense_kernel(kernel: str, device: torch.device, dense: str) -> str | None:
    if dense not in DENSE_CHOICES:
        raise ValueError(f"level attention dense parts {dense!r}: choose one of {DENSE_CHOICES}")
    if dense == "auto":  # cuDNN beats torch's own flash kernels on depth parts, not FA4's
        usable = (kernel == "flash" and flash_impl.active() != "FA4"
                  and cudnn_attention.usable(device, torch.bfloat16))
        return "cudnn" if usable else None
    return {"off": None, "cudnn-depth": "cudnn"}.get(dense, dense)


def _bounds(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def level_tree_attention(query, key, value, plan: LevelPlan, scaling) -> torch.Tensor:
    """Tree attention; inputs [1, heads, N, dim], output [1, N, heads, dim]."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, dim] views
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    dense = plan.dense_kernel != "cudnn" or q.shape[-1] in cudnn_attention.HEAD_DIMS
    layout, tensors = plan.parts(dense)
    out, _ = _level_attention(q, k, v, list(tensors), _encode(layout), float(scaling),
                              plan.kernel, plan.dense_kernel or "", plan.merge)
    return out[None]


# The split runs as a custom operator with its own backward operator, so a compiled layer
# calls it whole: dynamo and inductor see one opaque op (its shapes come from the fake
# functions) and never trace the parts. Traced as an autograd.Function instead, the flash
# path's gradients were wrong on an H200: dynamo listed the forward's intermediates among the
# function's outputs, the returned output was one of them twice over (the "rows" merge
# returns the self part's kernel output), and the gradient went to the unused copy (dq, dk,
# dv all zero; docs/performance.md).


@torch.library.custom_op("grpo_agent::level_attention", mutates_args=())
def _level_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     tensors: list[torch.Tensor], layout: list[int], scale: float, kernel: str,
                     dense_kernel: str, merge: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every part, merged: (out [N, heads, dim], lse [N, heads] float32 or wider)."""
    parts, merged = _decode(layout), level_merge.OutputMerge(q, merge)
    for (kind, ints), part in zip(parts, _split(parts, tensors)):
        merged.add(*_part_forward(kind, ints, part, q, k, v, scale, kernel, dense_kernel))
    out, lse = merged.result()
    return out.contiguous(), lse.contiguous()


@_level_attention.register_fake
def _(q, k, v, tensors, layout, scale, kernel, dense_kernel, merge):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=level_merge.work_dtype(q))


@torch.library.custom_op("grpo_agent::level_attention_backward", mutates_args=())
def _level_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              tensors: list[torch.Tensor], layout: list[int], scale: float,
                              kernel: str, dense_kernel: str,
                              merge: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every part's share of (dq, dk, dv), from the merged out and lse."""
    parts, grads, dout = _decode(layout), level_merge.GradSum(q, k, merge), dout.contiguous()
    for (kind, ints), part in zip(parts, _split(parts, tensors)):
        for rows, part_grads in _part_backward(kind, ints, part, dout, q, k, v, out, lse, scale,
                                               kernel, dense_kernel):
            grads.add(rows, part_grads)
    return tuple(g.contiguous() for g in grads.result())


@_level_attention_backward.register_fake
def _(dout, q, k, v, out, lse, tensors, layout, scale, kernel, dense_kernel, merge):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output) -> None:
    q, k, v, tensors, *args = inputs
    ctx.save_for_backward(q, k, v, *output, *tensors)
    ctx.args = args


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    dq, dk, dv = _level_attention_backward(dout, q, k, v, out, lse, tensors, *ctx.args)
    return dq, dk, dv, [None] * len(tensors), *[None] * len(ctx.args)


_level_attention.register_autograd(_backward, setup_context=_save)

# A part's kind, and how many ints and tensors follow it (`LevelPlan.parts`): "self" (the
# row's segments on the varlen kernel), "varlen" (a depth on the varlen kernel), "dense" (a
# padded batch on the dense kernel).
_KINDS = ("self", "varlen", "dense")
_PART_INTS = {"self": 1, "varlen": 2, "dense": 1}


def _encode(layout) -> list[int]:
    """The layout as the op's int list: each part's kind index, then its ints."""
    return [x for kind, ints in layout for x in (_KINDS.index(kind), *map(int, ints))]


def _decode(codes: list[int]) -> list[tuple[str, tuple[int, ...]]]:
    parts, at = [], 0
    while at < len(codes):
        kind = _KINDS[codes[at]]
        ints = tuple(codes[at + 1 : at + 1 + _PART_INTS[kind]])
        parts.append((kind, (bool(ints[0]),) if kind == "dense" else ints))  # dense: causal
        at += 1 + _PART_INTS[kind]
    return parts


_PART_TENSORS = {"self": 1, "varlen": 4, "dense": 7}


def _split(layout, tensors):
    at = 0
    for kind, _ in layout:
        yield tensors[at : at + _PART_TENSORS[kind]]
        at += _PART_TENSORS[kind]


def _part_forward(kind, ints, part, q, k, v, scale, kernel, dense_kernel):
    """(rows the part's queries are, or None for all in order; out; lse)."""
    if kind == "self":
        (cu,), (longest,) = part, ints
        out, lse = _FORWARD[kernel](q, k, v, cu, cu, longest, longest, True, scale)
        return None, out, lse
    if kind == "varlen":
        qi, ki, cu_q, cu_k = part
        out, lse = _FORWARD[kernel](q.index_select(0, qi), k.index_select(0, ki),
                                    v.index_select(0, ki), cu_q, cu_k, *ints, False, scale)
        return qi, out, lse
    q_index, q_valid, k_index, rows_q, pos_q, _, _ = part
    out, lse = _DENSE_FORWARD[dense_kernel](padded(q, q_index, q_valid), padded(k, k_index),
                                            padded(v, k_index), *ints, scale)
    return (rows_q, out.flatten(0, 1).index_select(0, pos_q),
            lse.flatten(0, 1).index_select(0, pos_q))


def _part_backward(kind, ints, part, dout, q, k, v, out, lse, scale, kernel, dense_kernel):
    """Yields (None, full-row grads) or ((query rows, key rows), their grads)."""
    backward = _BACKWARD[kernel]
    if kind == "self":
        (cu,), (longest,) = part, ints
        yield None, backward(dout, q, k, v, out, lse, cu, cu, longest, longest, True, scale)
        return
    if kind == "varlen":
        qi, ki, cu_q, cu_k = part
        yield (qi, ki), backward(dout.index_select(0, qi), q.index_select(0, qi),
                                 k.index_select(0, ki), v.index_select(0, ki),
                                 out.index_select(0, qi), lse.index_select(0, qi), cu_q, cu_k,
                                 *ints, False, scale)
        return
    q_index, q_valid, k_index, rows_q, pos_q, rows_k, pos_k = part
    at_q = [padded(x, q_index, q_valid) for x in (dout, q, out, lse)]
    dq, dk, dv = _DENSE_BACKWARD[dense_kernel](at_q[0], at_q[1], padded(k, k_index),
                                               padded(v, k_index), at_q[2], at_q[3], *ints, scale)
    yield (rows_q, rows_k), (dq.flatten(0, 1).index_select(0, pos_q),
                             dk.flatten(0, 1).index_select(0, pos_k),
                             dv.flatten(0, 1).index_select(0, pos_k))


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


def _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    unused = torch.empty(2, dtype=torch.uint64, device=q.device)  # dropout 0: no random state
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.t().contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, unused,
        unused, scale=scale,
    )


def _reference_scores(q, k, cu_q, cu_k, causal, scale):
    """Scores [heads, Q, K] in float32 (or wider) with every pair outside a sequence (or after
    the bottom-right causal diagonal) at -inf: dense, but no host synchronisation."""
    work = level_merge.work_dtype(q)
    rows_q = torch.arange(q.shape[0], device=q.device)
    rows_k = torch.arange(k.shape[0], device=q.device)
    seq_q = torch.searchsorted(cu_q, rows_q.to(cu_q.dtype), right=True) - 1
    seq_k = torch.searchsorted(cu_k, rows_k.to(cu_k.dtype), right=True) - 1
    visible = seq_q[:, None] == seq_k[None, :]
    if causal:
        q_from_end = cu_q[seq_q + 1] - rows_q  # 1 for a sequence's last query
        k_from_end = cu_k[seq_k + 1] - rows_k
        visible &= k_from_end[None, :] >= q_from_end[:, None]
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.to(work), k.to(work).repeat_interleave(group, 1))
    return (scores * scale).masked_fill(~visible, float("-inf"))


def _reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    scores = _reference_scores(q, k, cu_q, cu_k, causal, scale)
    vs = v.to(scores.dtype).repeat_interleave(q.shape[1] // k.shape[1], 1)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out.to(q.dtype), scores.logsumexp(-1).t()


def _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    scores = _reference_scores(q, k, cu_q, cu_k, causal, scale)
    work, group, heads_k = scores.dtype, q.shape[1] // k.shape[1], k.shape[1]
    probs = torch.exp(scores - lse.t()[..., None].to(work))
    do, o = dout.to(work), out.to(work)
    kk, vv = (t.to(work).repeat_interleave(group, 1) for t in (k, v))
    dscores = probs * (torch.einsum("qhd,khd->hqk", do, vv) - (do * o).sum(-1).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", dscores, kk) * scale
    dk = torch.einsum("hqk,qhd->khd", dscores, q.to(work)) * scale
    dv = torch.einsum("hqk,qhd->khd", probs, do)
    dk, dv = (t.unflatten(1, (heads_k, group)).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _dense_reference_forward(q, k, v, causal, scale):
    """The dense contract ([B, L, heads, dim]) through the varlen reference: B equal ranges."""
    (batch, len_q), len_k = q.shape[:2], k.shape[1]
    cu_q, cu_k = (torch.arange(0, batch * n + 1, n, device=q.device) for n in (len_q, len_k))
    out, lse = _reference_forward(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                  len_q, len_k, causal, scale)
    return out.unflatten(0, (batch, len_q)), lse.unflatten(0, (batch, len_q))


def _dense_reference_backward(dout, q, k, v, out, lse, causal, scale):
    (batch, len_q), len_k = q.shape[:2], k.shape[1]
    cu_q, cu_k = (torch.arange(0, batch * n + 1, n, device=q.device) for n in (len_q, len_k))
    grads = _reference_backward(*(t.flatten(0, 1) for t in (dout, q, k, v, out, lse)), cu_q,
                                cu_k, len_q, len_k, causal, scale)
    return tuple(g.unflatten(0, (batch, -1)) for g in grads)


_FORWARD = {"flash": _flash_forward, "reference": _reference_forward}
_BACKWARD = {"flash": _flash_backward, "reference": _reference_backward}
_DENSE_FORWARD = {"cudnn": cudnn_attention.cudnn_forward, "reference": _dense_reference_forward}
_DENSE_BACKWARD = {"cudnn": cudnn_attention.cudnn_backward,
                   "reference": _dense_reference_backward}
