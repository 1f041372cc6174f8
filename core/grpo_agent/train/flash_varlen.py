"""Optional flash-attention varlen kernel for packed rows that share nothing.

Design decision: a row in which no segment has an ancestor (plain padding-free packing) only
needs block-diagonal causal attention, which a varlen flash kernel computes from the segment
boundaries (`cu_seqlens`) without any mask. We use such a kernel only when it is already
available, never as a dependency:

- `GRPO_AGENT_FLASH_KERNEL` names one explicitly, loaded through the `kernels` library: a
  local kernel directory (`kernels.get_local_kernel`), or a Hub repo `org/name@REVISION`
  (`kernels.get_kernel`; with `HF_HUB_OFFLINE=1` it only reads the local Hub cache, without
  it naming the repo is the user's permission to download);
- otherwise an installed `flash_attn` package;
- otherwise none, and rows keep the FlexAttention tree path.

A kernel that fails to load is reported once as a warning and the tree path is used.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KERNEL_ENV = "GRPO_AGENT_FLASH_KERNEL"
HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def varlen_kernel() -> Callable | None:
    """`flash_attn_varlen_func` of the configured or installed kernel, or None (cached)."""
    return load_varlen_kernel(os.environ.get(KERNEL_ENV, "").strip())


def load_varlen_kernel(spec: str) -> Callable | None:
    """Load from `spec` (see the module docstring; "" = an installed flash_attn, if any)."""
    if not spec:
        try:
            return importlib.import_module("flash_attn").flash_attn_varlen_func
        except Exception as exc:  # noqa: BLE001 -- absent, or built for another torch/CUDA
            log.debug("no flash_attn package (%s): packed rows use the tree path", exc)
            return None
    try:
        return _from_kernels_library(spec).flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 -- any load failure: the tree path is correct
        log.warning(
            "%s=%r could not be loaded (%s); using the FlexAttention tree path. Unset it, or "
            "point it at a local kernel directory or a Hub repo as org/name@REVISION.",
            KERNEL_ENV,
            spec,
            exc,
        )
        return None


def _from_kernels_library(spec: str):
    import kernels

    path = Path(spec).expanduser()
    if path.exists():
        return kernels.get_local_kernel(path)
    repo_id, _, revision = spec.partition("@")
    if not revision:
        raise ValueError(f"{spec!r} names no local directory and no @REVISION (or @VERSION)")
    if revision.isdigit():
        return kernels.get_kernel(repo_id, version=int(revision))
    return kernels.get_kernel(repo_id, revision=revision)


def row_is_unshared(segment_ancestors: torch.Tensor) -> bool:
    """True when every segment's only ancestor is itself (nothing in the row is shared)."""
    return int(segment_ancestors.sum()) == segment_ancestors.shape[0]


def cu_seqlens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(int32 [S+1] segment boundaries, longest segment) of a depth-first packed row."""
    _, counts = torch.unique_consecutive(segment_ids, return_counts=True)
    bounds = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    return bounds, int(counts.max())


def varlen_attention(kernel, query, key, value, bounds, longest, scaling) -> torch.Tensor:
    """Causal attention within each segment; inputs [1, heads, N, dim], output [1, N, heads, dim]."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    out = kernel(q, k, v, bounds, bounds, longest, longest, softmax_scale=scaling, causal=True)
    if isinstance(out, tuple):  # flash-attn 3 also returns the log-sum-exp
        out = out[0]
    return out[None]
