"""Tree attention: a transformers attention backend for tree-packed rows.

Design decision: the trie's visibility rule is one predicate, "key j is visible to query i iff
j's segment is on i's path and j <= i" (ancestor segments precede their descendants in the
depth-first layout, so `j <= i` is also the causal rule inside a segment). We build it once
per row (`TreeMask`) and hand it to every layer through the model's forward kwargs, under
the attention implementation name `grpo_tree` registered with `AttentionInterface`. Because
that name has no mask function in transformers, the model builds no mask of its own.

Kernels: "varlen" is one flash-attention varlen call in which each segment's queries attend
to the keys/values gathered along its path (`varlen_attention`; PyTorch's own flash build or
an installed/configured flash-attn kernel), which "auto" picks on CUDA in half precision for
rows under LEVELS_MIN_TOKENS. "levels" splits the tree by depth into flash calls on the row's
own keys, merged by their log-sum-exps (`level_attention`): less GPU work and memory than
"varlen" (no gathered keys, no scatter-add of their gradients) but more kernels per layer, so
"auto" picks it for rows long enough that the GPU, not the host queueing kernels, sets the
pace (measured on an H200: docs/performance.md). "masked" is one FlashAttention 4 call per
layer with the predicate as the kernel's mask and the trie as its block sparsity
(`masked_attention`; Hopper/Blackwell with flash-attn-4): neither gathered keys nor parts;
"auto" picks it over both for rows of MASKED_MIN_TOKENS or more wherever FA4 runs (heads over
128 wide: over "levels" only, from LEVELS_MIN_TOKENS). Otherwise
on CUDA, "flex": FlexAttention with a block mask built from the predicate (sparse blocks are
skipped). On CPU, where FlexAttention has no backward, "gather": the same plan as
"varlen" with one SDPA call per segment (work and memory grow with the sum of segment x path
lengths, not N^2).
"sdpa" (one SDPA call with the dense [N, N] boolean mask) is the simple reference and the
fallback for sliding-window layers and attention dropout.
Rotary positions come from `position_ids` (the token's depth), so they match unpacked
forwards; grouped-query attention uses the kernels' GQA support. Attention sinks change the
softmax denominator and are rejected; so is attention-logit softcapping (Gemma 2), which no
path applies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from grpo_agent.train import (
    flash_impl,
    gated_deltanet,
    level_attention,
    masked_attention,
    varlen_attention,
)
from grpo_agent.train.packing import PackedRow
from grpo_agent.train.transfer import to_device

ATTN_IMPLEMENTATION = "grpo_tree"
FLEX_BLOCK_SIZE = 128
# Rows of at least this many tokens take "levels" under "auto": on an H200 (Qwen3-1.7B shape,
# 16k-token rows, eager) it was 2.8% faster than "varlen" with 4.4 GiB less peak memory; with
# its merge fused (compiled layers), 1.4-2.2% faster on group rows (four H100 runs) and 4.3% on
# one-prompt rows, with 5-7 GiB less (docs/performance.md).
LEVELS_MIN_TOKENS = 12288
# Rows of at least this many tokens take "masked" under "auto" where FlashAttention 4 runs
# (which `auto` turns on from token budgets of 8,192, or for CUDA graphs): on an H100 it beat
# varlen wherever measured, by most at the shortest rows: one layer at 5,865 and 14,703 tokens,
# the trainer's step at 7,961, eager rows of 5.9k (0.91-0.99x), graphed rows of 5.9-6.8k
# (0.92-0.94x) and of 2.8-3.5k (0.79-0.83x). Rows under 2,048 are unmeasured
# (docs/performance.md).
MASKED_MIN_TOKENS = 2048
# Heads wider than this (Qwen3.5's 256) take "masked" only where it replaces "levels" (rows of
# LEVELS_MIN_TOKENS or more): one such layer on an H100 took 3.46 ms masked, 5.13 levels, 3.68
# varlen at 14.7k tokens, but 2.39 masked against 1.93 varlen at 5.9k (bench/tree_paths.py
# --heads 8:2:256).
MASKED_MIN_TOKENS_MAX_HEAD_DIM = 128
COMPILE_BLOCK_MASK = True  # compiled mask construction: no [N, N] tensor on the GPU


@dataclass
class TreeMask:
    """The visibility structure of one packed row, in the layout the kernel wants."""

    segment_ids: torch.Tensor  # [N]
    ancestors: torch.Tensor  # [S, S] bool
    position_ids: torch.Tensor  # [N]
    backend: str  # one of BACKENDS
    block_mask: Any = None  # FlexAttention BlockMask (flex)
    varlen: varlen_attention.VarlenPlan | None = None  # query/key bounds, gather index
    levels: level_attention.LevelPlan | None = None  # self and per-depth bounds
    masked: masked_attention.MaskedPlan | None = None  # until, FA4 block lists (masked)
    dense: torch.Tensor | None = None  # [N, N] bool (sdpa)
    linear: Any = None  # gated_deltanet.DeltaPlan for Gated DeltaNet layers (hybrid models)

    @classmethod
    def build(
        cls,
        row: PackedRow,
        device: torch.device | str,
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
    ) -> TreeMask:
        """`dtype` (the model's) lets "auto" pick a flash path, which is half-precision only;
        `head_dim` (its attention heads') whether FlashAttention 4's masked path fits."""
        device = torch.device(device)
        if backend == "auto":
            backend = choose_backend(device, dtype, row.num_tokens, head_dim)
        if backend not in BACKENDS:
            raise ValueError(
                f"tree attention backend {backend!r}: choose 'auto' or one of {BACKENDS}."
            )
        kernel = varlen_attention.varlen_kernel() if backend == "varlen" else None
        if backend == "varlen" and kernel is None:
            raise ValueError(_NO_VARLEN_KERNEL)
        segment_ids, ancestors, position_ids = to_device(
            device, row.segment_ids, row.segment_ancestors, row.position_ids
        )
        mask = cls(segment_ids, ancestors, position_ids, backend)
        if backend == "flex":
            mask.block_mask = _flex_block_mask(mask.segment_ids, mask.ancestors)
        elif backend in ("varlen", "gather"):
            mask.varlen = varlen_attention.VarlenPlan.build(
                row, device, kernel or varlen_attention.sdpa_varlen
            )
        elif backend == "levels":
            mask.levels = level_attention.LevelPlan.build(row, device, _level_kernel(device, dtype))
        elif backend == "masked":
            mask.masked = masked_attention.MaskedPlan.build(
                visible_until(mask.segment_ids, mask.ancestors), masked_kernel(device, dtype),
                masked_attention.key_block(head_dim))
        else:
            mask.dense = dense_tree_mask(mask.segment_ids, mask.ancestors)
        return mask


BACKENDS = ("varlen", "levels", "masked", "flex", "gather", "sdpa")


def masked_kernel(device: torch.device, dtype: torch.dtype | None) -> str:
    """FlashAttention 4 on CUDA; on CPU the dense reference (quadratic memory: tests)."""
    if device.type != "cuda":
        return "reference"
    missing = flash_impl.fa4_kernels_missing(device)
    if dtype not in varlen_attention.HALF_DTYPES:
        missing = f"a {dtype} model (FlashAttention 4 runs bf16/fp16)"
    if missing:
        raise ValueError(
            f"the 'masked' tree attention backend runs FlashAttention 4, which cannot run here: "
            f"{missing}. Install flash-attn-4 on a Hopper/Blackwell GPU with a bf16 model, or "
            "use backend='auto'.")
    return "fa4"


def _level_kernel(device: torch.device, dtype: torch.dtype | None) -> str:
    """flash on CUDA; on CPU the dense reference (quadratic memory: for tests and tiny rows)."""
    if device.type != "cuda":
        return "reference"
    if dtype in varlen_attention.HALF_DTYPES and torch.backends.cuda.is_flash_attention_available():
        flash_impl.torch_flash_impl()
        return "flash"
    raise ValueError(
        f"the 'levels' tree attention backend needs flash attention on CUDA: a bf16/fp16 model "
        f"and a torch build with flash (got {dtype}). Use backend='auto' (flex for float32)."
    )


def choose_backend(device: torch.device, dtype: torch.dtype | None, tokens: int = 0,
                   head_dim: int | None = None) -> str:
    """gather on CPU. On CUDA in half precision with flash kernels: masked for rows of at least
    MASKED_MIN_TOKENS where torch's flash ops run FlashAttention 4 (`flash_impl`) and the
    heads fit its blocks, from LEVELS_MIN_TOKENS for 256-wide heads; otherwise levels for
    rows of at least LEVELS_MIN_TOKENS, varlen below; varlen was as fast as flex or faster for
    every packing ratio on an H200, eager and compiled; else flex. Each bound's measurements
    are with its constant above."""
    if device.type != "cuda":
        return "gather"
    if dtype not in varlen_attention.HALF_DTYPES or not varlen_attention.flash_capable(device):
        return "flex"
    if head_dim is not None and masked_attention.fa4_runs(head_dim):
        narrow = head_dim <= MASKED_MIN_TOKENS_MAX_HEAD_DIM
        masked_from = MASKED_MIN_TOKENS if narrow else LEVELS_MIN_TOKENS
        if tokens >= masked_from and flash_impl.torch_flash_impl() == "FA4":
            return "masked"
    if tokens >= LEVELS_MIN_TOKENS and torch.backends.cuda.is_flash_attention_available():
        return "levels"
    return "varlen" if varlen_attention.varlen_kernel() is not None else "flex"


_NO_VARLEN_KERNEL = (
    "the 'varlen' tree attention backend needs a flash-attention varlen kernel and none is "
    "available (this torch has no CUDA flash build): install flash-attn, set "
    f"{varlen_attention.KERNEL_ENV} to a local kernel directory or org/name@REVISION (loaded with "
    "the `kernels` library), or use backend='auto'."
)


def dense_tree_mask(segment_ids: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: query i sees key j iff seg(j) is on seg(i)'s path and j <= i."""
    n = segment_ids.numel()
    idx = torch.arange(n, device=segment_ids.device)
    on_path = ancestors[segment_ids[:, None], segment_ids[None, :]]
    return on_path & (idx[None, :] <= idx[:, None])


def visible_until(segment_ids: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """[N] long: one past the last query that may see key j (the end of j's segment's subtree).

    In the depth-first layout a segment's subtree is one contiguous range that starts at the
    segment, so the tree rule "seg(j) is on seg(i)'s path and j <= i" is the interval test
    `j <= i < visible_until[j]`: one load per score in the attention kernel instead of three
    dependent ones (segment of i, segment of j, ancestor table)."""
    segments = ancestors.shape[0]
    seg_stop = torch.zeros(segments, dtype=torch.long, device=segment_ids.device)
    positions = torch.arange(1, segment_ids.numel() + 1, device=segment_ids.device)
    seg_stop.scatter_reduce_(0, segment_ids, positions, reduce="amax")
    # [s, a] = a is on s's path; the subtree of a ends where its last descendant segment stops
    subtree_stop = torch.where(ancestors, seg_stop[:, None], 0).amax(dim=0)
    return subtree_stop[segment_ids]


def _flex_block_mask(segment_ids: torch.Tensor, ancestors: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    until = visible_until(segment_ids, ancestors)

    def tree_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < until[kv_idx])

    n = segment_ids.numel()
    return create_block_mask(
        tree_mask_mod,
        B=None,
        H=None,
        Q_LEN=n,
        KV_LEN=n,
        device=segment_ids.device,
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
        _compile=COMPILE_BLOCK_MASK,
    )


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.cache
def _training_kernel_options() -> dict[str, Any]:
    """Force the full FlexAttention kernel: for rows under 128 tokens the AUTO choice is the
    decoding kernel, which fails to compile for training (seen on torch 2.11, H200)."""
    from torch.nn.attention.flex_attention import FlexKernelOptions

    if "BACKEND" in getattr(FlexKernelOptions, "__annotations__", {}):
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}


def _window_mask(tree: TreeMask, window: int) -> torch.Tensor:
    pos = tree.position_ids
    return tree.dense & ((pos[:, None] - pos[None, :]) < window)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree_mask: TreeMask | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over one packed row; inputs [1, heads, N, dim], output [1, N, heads, dim]."""
    if tree_mask is None:
        raise ValueError(
            f"The model uses attn_implementation={ATTN_IMPLEMENTATION!r} but was called without a "
            "packed row: call grpo_agent.train.forward.forward_hidden(model, row), or switch the "
            "model back with model.set_attn_implementation('sdpa') for ordinary inputs."
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"tree attention takes one packed row per forward, got batch {query.shape[0]}."
        )
    if getattr(module, "sinks", None) is not None:
        raise ValueError(_SINKS_ERROR)
    if kwargs.get("softcap"):  # transformers passes the config's attn_logit_softcapping
        raise ValueError(_softcap_error(kwargs["softcap"]))
    gqa = query.shape[1] != key.shape[1]
    # Sliding windows and attention dropout need the dense mask.
    plain = not sliding_window and not (dropout and module.training)
    if plain and tree_mask.backend == "levels":
        # One custom op (its backward another): called whole from a compiled decoder layer.
        return level_attention.level_tree_attention(
            query, key, value, tree_mask.levels, scaling
        ), None
    if plain and tree_mask.backend == "masked":
        return masked_attention.masked_tree_attention(
            query, key, value, tree_mask.masked, scaling
        ), None
    if plain and tree_mask.backend == "varlen":
        # One kernel call on tensors: traced into a compiled decoder layer (`regional_compile`).
        return varlen_attention.tree_varlen_attention(
            query, key, value, tree_mask.varlen, scaling
        ), None
    if plain and tree_mask.backend == "gather":
        return _eager_gather_attention(query, key, value, tree_mask.varlen, scaling), None
    if tree_mask.backend != "flex":
        return _dense_tree_attention(module, query, key, value, scaling, dropout, tree_mask,
                                     sliding_window, gqa)
    if sliding_window:
        raise NotImplementedError(
            "sliding-window layers are not supported by the flex tree path yet."
        )
    out = _compiled_flex_attention()(
        query,
        key,
        value,
        block_mask=tree_mask.block_mask,
        scale=scaling,
        enable_gqa=gqa,
        kernel_options=_training_kernel_options(),
    )
    return out.transpose(1, 2).contiguous(), None


# The gather and dense paths stay eager: the gather loops over the row's segments, which would
# recompile a compiled decoder layer for every new row.
_eager_gather_attention = torch.compiler.disable(varlen_attention.tree_varlen_attention)


@torch.compiler.disable
def _dense_tree_attention(module, query, key, value, scaling, dropout, tree_mask: TreeMask,
                          sliding_window, gqa) -> tuple[torch.Tensor, None]:
    """SDPA with the dense [N, N] mask: the reference, sliding windows and attention dropout."""
    if tree_mask.dense is None:
        tree_mask.dense = dense_tree_mask(tree_mask.segment_ids, tree_mask.ancestors)
    dense = _window_mask(tree_mask, sliding_window) if sliding_window else tree_mask.dense
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=dense,
        scale=scaling,
        dropout_p=dropout if module.training else 0.0,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2).contiguous(), None


_SINKS_ERROR = (
    "This model uses attention sinks (e.g. gpt-oss), which add a learned term to every softmax "
    "denominator; tree attention does not implement them. Train it without tree packing."
)


def _softcap_error(softcap: float) -> str:
    return (
        f"This model caps its attention logits (attn_logit_softcapping={softcap}, e.g. Gemma 2); "
        "no tree attention path applies the cap (varlen, levels, masked, flex, gather, sdpa), so "
        "its log-probs would be wrong. Train a model without attention softcapping."
    )


def register_tree_attention() -> None:
    """Make `grpo_tree` a known attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)


def enable_tree_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model to tree attention; reject what it cannot pack correctly."""
    for name, sub in model.named_modules():
        if getattr(sub, "sinks", None) is not None:
            raise ValueError(f"{_SINKS_ERROR} (found at module {name!r})")
    softcap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(_softcap_error(softcap))
    # Gated DeltaNet layers take the tree path; other recurrent layer types are refused.
    gated_deltanet.install(model)
    register_tree_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
