"""Tree attention as one FlashAttention 4 call: the tree is the kernel's mask, the trie its
block sparsity.

Design decision: in the depth-first layout, key j is visible to query i iff
`j <= i < until[j]` (`tree_attention.visible_until`: where j's segment's subtree ends). FA4's
CuTe DSL kernels take such a rule as a `mask_mod` evaluated inside the tile, and a list of the
128-query x 128-key blocks (64-key for heads over 128 wide: `key_block`) worth visiting per
query block (and per key block, for the backward), split
into *full* blocks (every pair visible: no mask work) and *partial* ones (the rule applied per
score). So one forward and one backward call per layer cover the whole row:
- no gathered copies of ancestor keys and no scatter-add of their gradients (the varlen path's
  cost: a shared prompt is read once, not once per completion);
- no depth parts and no log-sum-exp merges (the level path's cost: extra kernels, index
  copies, element-wise float32 work per depth);
- the work is the visible pairs rounded out to 128 x 128 blocks.

The block lists come from `until` with tensor ops (no host synchronisation, a few MB at 16k
tokens): a block pair is *visible* iff some key j of the key block has j < the query block's end
and until[j] > its start; *full* iff the key block ends at or before the query block starts and
every key's until reaches past the query block's end (blocks with padding are never full).

Measured on an H100 (docs/performance.md): one layer alone 0.66-0.84x the best other path's
time; in the compiled 1.7B step at 16k rows 2.7-3.1% faster than levels at G=8 (MFU 0.486),
level at G=56 (its kernels run slower than the level parts' in the model: mask work in the
partial blocks, 36-39% of those visited, and 1.2x block rounding); the trainer's 8k-row step
5-6% faster than varlen. So `tree_attention.choose_backend` takes it wherever FA4 runs (256-wide
heads from longer rows).

Kernels: "fa4" (CUDA, bf16/fp16, flash-attn-4 installed, compute capability 9.x/10.x) or
"reference": the same contract in dense float32 math (float64 for float64 inputs) that applies
the *block lists* (full blocks unmasked, partial blocks through the rule, the rest skipped), so
the tests check the lists, not just the rule. Wrapped in one custom op (and one backward op)
that compiled decoder layers call whole, like `level_attention`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 128  # query blocks; key blocks too for heads up to 128 wide (FA4's Hopper tiles)
# Wider heads take 64-key blocks: FA4's block-sparse Hopper backward tiles 256-wide heads by 64
# keys and its forward shrinks its key tile to the lists' key block. Heads up to 128 wide and
# 256 wide have run on a GPU against the reference; FA4 tiles the widths between (its 192-wide
# backward) by 96 keys, which fits neither block, so they are refused.
FA4_WIDE_HEAD = 256
KERNELS = ("fa4", "reference")


def fa4_runs(head_dim: int) -> bool:
    """Whether FA4's masked kernels take heads this wide (see FA4_WIDE_HEAD)."""
    return head_dim <= BLOCK or head_dim == FA4_WIDE_HEAD


def key_block(head_dim: int | None) -> int:
    """Keys per block for heads this wide: 128 up to 128 wide, 64 above."""
    return 64 if head_dim is not None and head_dim > BLOCK else BLOCK


@dataclass
class MaskedPlan:
    """One row's mask for the kernel: `until` padded to whole blocks (padding keys are seen by
    no query) and the block lists, forward (per query block) then backward (per key block)."""

    until: torch.Tensor  # [query blocks * BLOCK] int32
    blocks: list[torch.Tensor]  # fwd partial cnt/idx, fwd full cnt/idx, bwd likewise
    kernel: str

    @property
    def key_block(self) -> int:
        return _key_block_of(self.until, self.blocks)

    @classmethod
    def build(cls, until: torch.Tensor, kernel: str, key_block: int = BLOCK) -> MaskedPlan:
        if kernel not in KERNELS:
            raise ValueError(f"masked attention kernel {kernel!r}: choose one of {KERNELS}")
        padded, visible, full = block_pairs(until, key_block)
        partial = visible & ~full
        blocks = [*_lists(partial), *_lists(full), *_lists(partial.T), *_lists(full.T)]
        return cls(padded, blocks, kernel)


def _spans(tokens: int, count: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, stops) of `count` blocks of `size` over `tokens` (the last ones may be short
    or empty)."""
    starts = torch.arange(count, device=device) * size
    return starts, torch.clamp(starts + size, max=tokens)


def block_pairs(until: torch.Tensor, key_block: int = BLOCK):
    """(until padded to whole query blocks as int32, visible [Mb, Nb] bool, full [Mb, Nb]
    bool) for BLOCK-query by `key_block`-key blocks (`key_block` divides BLOCK)."""
    tokens = until.numel()
    count = -(-tokens // BLOCK)
    key_count = count * BLOCK // key_block
    padded = torch.zeros(count * BLOCK, dtype=torch.int32, device=until.device)
    padded[:tokens] = until.to(torch.int32)
    keys = torch.arange(count * BLOCK, device=until.device)
    starts, stops = _spans(tokens, count, BLOCK, until.device)
    key_starts, key_stops = _spans(tokens, key_count, key_block, until.device)
    # key j is visible to some query in [start, stop) iff j < stop and until[j] > start
    visible = ((keys[None, :] < stops[:, None]) & (padded[None, :] > starts[:, None]))
    visible = visible.view(count, key_count, key_block).any(-1)
    key_last = key_stops - 1  # the last key of each key block (padding keys have until 0)
    key_min_until = padded.view(key_count, key_block).amin(-1)
    whole = (stops - starts) == BLOCK
    whole_keys = (key_stops - key_starts) == key_block
    full = ((key_last[None, :] <= starts[:, None]) & (key_min_until[None, :] >= stops[:, None])
            & whole[:, None] & whole_keys[None, :])
    return padded, visible, full & visible


def _lists(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's block list form: counts [1, 1, rows] and, per row, the listed columns first in
    ascending order ([1, 1, rows, cols], int32)."""
    counts = pairs.sum(-1, dtype=torch.int32)
    order = torch.sort((~pairs).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts[None, None].contiguous(), order[None, None].contiguous()


def masked_tree_attention(query, key, value, plan: MaskedPlan, scaling) -> torch.Tensor:
    """Tree attention; inputs [1, heads, N, dim], output [1, N, heads, dim]."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, dim] views
    if plan.kernel == "fa4" and not fa4_runs(q.shape[-1]):
        raise ValueError(
            f"the 'masked' tree attention backend runs FlashAttention 4 for heads up to {BLOCK} "
            f"wide or {FA4_WIDE_HEAD} wide (this model: {q.shape[-1]}). Use backend='auto' "
            "(varlen or levels) for this model.")
    if plan.key_block != key_block(q.shape[-1]):
        raise ValueError(
            f"this masked plan has {plan.key_block}-key blocks; heads {q.shape[-1]} wide need "
            f"{key_block(q.shape[-1])}: build it with TreeMask.build(..., head_dim="
            f"{q.shape[-1]}).")
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out, _ = _masked_attention(q, k, v, plan.until, list(plan.blocks), float(scaling),
                               plan.kernel)
    return out[None]


@torch.library.custom_op("grpo_agent::masked_attention", mutates_args=())
def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, until: torch.Tensor,
                      blocks: list[torch.Tensor], scale: float,
                      kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, heads, dim], lse [heads, N] in `_stats_dtype`)."""
    return tuple(t.contiguous() for t in _FORWARD[kernel](q, k, v, until, blocks, scale))


@_masked_attention.register_fake
def _(q, k, v, until, blocks, scale, kernel):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=_stats_dtype(q))


def _stats_dtype(q: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the reference in the CPU tests' precision)."""
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.custom_op("grpo_agent::masked_attention_backward", mutates_args=())
def _masked_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                               until: torch.Tensor, blocks: list[torch.Tensor], scale: float,
                               kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _BACKWARD[kernel](dout.contiguous(), q, k, v, out, lse, until, blocks, scale)
    return tuple(g.contiguous() for g in grads)


@_masked_attention_backward.register_fake
def _(dout, q, k, v, out, lse, until, blocks, scale, kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output) -> None:
    q, k, v, until, blocks, scale, kernel = inputs
    ctx.save_for_backward(q, k, v, *output, until, *blocks)
    ctx.args = (scale, kernel)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, until, *blocks = ctx.saved_tensors
    dq, dk, dv = _masked_attention_backward(dout, q, k, v, out, lse, until, blocks, *ctx.args)
    return dq, dk, dv, None, [None] * len(blocks), None, None


_masked_attention.register_autograd(_backward, setup_context=_save)


# FlashAttention 4 ------------------------------------------------------------------------


@functools.cache
def tree_mask_mod():
    """The tree rule as FA4's mask_mod: key n visible to query m iff n <= m < until[n]."""
    import cutlass
    from cutlass import cute
    from flash_attn.cute import utils

    @cute.jit
    def tree_visible(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        until = aux_tensors[0]
        stop = utils.scalar_to_ssa(until[n_idx[0]], cutlass.Int32)
        return (n_idx <= m_idx) & (m_idx < stop)

    return tree_visible


def _key_block_of(until: torch.Tensor, blocks) -> int:
    """Keys per block of a plan's lists (all eight, forward first): the padded row over the
    forward lists' key-block count."""
    return until.numel() // blocks[1].shape[-1]


def _sparse(lists, key_block: int):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    return BlockSparseTensorsTorch(*lists, block_size=(BLOCK, key_block))


def _fa4_forward(q, k, v, until, blocks, scale):
    from flash_attn.cute import interface

    out, lse = interface._flash_attn_fwd(
        q[None], k[None], v[None], softmax_scale=scale, causal=False, mask_mod=tree_mask_mod(),
        aux_tensors=[until], return_lse=True,
        block_sparse_tensors=_sparse(blocks[:4], _key_block_of(until, blocks)))[:2]
    return out[0], lse[0]


def _fa4_backward(dout, q, k, v, out, lse, until, blocks, scale):
    from flash_attn.cute import interface

    dq, dk, dv = interface._flash_attn_bwd(
        q[None], k[None], v[None], out[None], dout[None], lse[None], scale, False,
        mask_mod=tree_mask_mod(), aux_tensors=[until],
        block_sparse_tensors=_sparse(blocks[4:], _key_block_of(until, blocks)))[:3]
    return dq[0], dk[0], dv[0]


# The reference: dense float32 math over the mask the block lists describe ------------------


def listed_mask(until: torch.Tensor, counts, indices, full_counts, full_indices, tokens: int,
                transposed: bool = False) -> torch.Tensor:
    """[tokens, tokens] bool: what a kernel following these block lists attends (query rows,
    key columns): full blocks whole, partial blocks through the tree rule, others nothing."""
    partial = _dense_pairs(counts, indices)
    full = _dense_pairs(full_counts, full_indices)
    if transposed:
        partial, full = partial.T, full.T
    expand = functools.partial(_expand_blocks, tokens=tokens,
                               key_block=until.numel() // partial.shape[1])
    idx = torch.arange(tokens, device=until.device)
    rule = (idx[None, :] <= idx[:, None]) & (idx[:, None] < until[:tokens].long()[None, :])
    return expand(full) | (expand(partial) & rule)


def _dense_pairs(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    counts, indices = counts[0, 0], indices[0, 0].long()
    rows, cols = indices.shape
    listed = torch.arange(cols, device=indices.device)[None, :] < counts[:, None]
    pairs = torch.zeros(rows, cols + 1, dtype=torch.bool, device=indices.device)
    pairs.scatter_(1, torch.where(listed, indices, cols), True)
    return pairs[:, :cols]


def _expand_blocks(pairs: torch.Tensor, tokens: int, key_block: int) -> torch.Tensor:
    return pairs.repeat_interleave(BLOCK, 0).repeat_interleave(key_block, 1)[:tokens, :tokens]


def _float_scores(q, k, v, mask, scale):
    """q, k, v in `_stats_dtype` with k/v repeated per query head; masked scores [heads, q,
    k]."""
    groups, dtype = q.shape[1] // k.shape[1], _stats_dtype(q)
    qf, kf, vf = q.to(dtype), *(t.to(dtype).repeat_interleave(groups, 1) for t in (k, v))
    scores = (torch.einsum("qhd,khd->hqk", qf, kf) * scale).masked_fill(~mask[None], float("-inf"))
    return qf, kf, vf, scores


def _reference_attention(q, k, v, mask, scale):
    _, _, vf, scores = _float_scores(q, k, v, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [heads, N]
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), vf)
    return out, lse


def _reference_forward(q, k, v, until, blocks, scale):
    mask = listed_mask(until, *blocks[:4], q.shape[0])
    out, lse = _reference_attention(q, k, v, mask, scale)
    return out.to(q.dtype), lse


def _reference_backward(dout, q, k, v, out, lse, until, blocks, scale):
    """The softmax backward by hand (a custom op's body runs below autograd)."""
    mask = listed_mask(until, *blocks[4:], q.shape[0], transposed=True)
    qf, kf, vf, scores = _float_scores(q, k, v, mask, scale)
    do = dout.to(qf.dtype)
    probs = torch.exp(scores - lse.to(qf.dtype)[..., None])  # [heads, q, k]
    dv = torch.einsum("hqk,qhd->khd", probs, do)
    dprobs = torch.einsum("qhd,khd->hqk", do, vf)
    row = (do * out.to(qf.dtype)).sum(-1).T  # [heads, q]
    dscores = probs * (dprobs - row[..., None]) * scale
    dq = torch.einsum("hqk,khd->qhd", dscores, kf)
    dk = torch.einsum("hqk,qhd->khd", dscores, qf)
    dk, dv = (g.unflatten(1, (k.shape[1], -1)).sum(2) for g in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_FORWARD = {"fa4": _fa4_forward, "reference": _reference_forward}
_BACKWARD = {"fa4": _fa4_backward, "reference": _reference_backward}
