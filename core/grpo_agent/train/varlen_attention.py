"""Tree attention through a varlen flash kernel: each segment's queries against its gathered path.

Design decision: a segment's queries see exactly its path (the ancestors' tokens, then its own
tokens causally), which is "causal, aligned bottom-right" attention of a short query sequence
against a longer key sequence: what flash-attention's varlen kernels compute from
`cu_seqlens_q` / `cu_seqlens_k`. So the whole row is one kernel call: queries stay where they
are (a segment's own tokens are contiguous), keys and values are gathered along every
segment's path (`VarlenPlan.kv_index`; skipped when nothing is shared), and the gather's
backward sums a shared token's gradients in float32. The kernel runs dense tiles on exactly the
visible pairs; on an H200 the whole step was as fast as FlexAttention's masked blocks or faster
(the gather's copies eat most of the kernel's gain: docs/performance.md).

Kernels, first found wins, resolved at the first CUDA half-precision row (never at import):
- `GRPO_AGENT_FLASH_KERNEL` names one, loaded through the `kernels` library: a local kernel
  directory (`kernels.get_local_kernel`), or a Hub repo `org/name@REVISION`
  (`kernels.get_kernel`);
- the spec's Hub kernel for this GPU (`hub_kernel_repo`), through `kernels.get_kernel` at the
  major version transformers pins: kernels-community/aiter-flash-attn on AMD (ROCm),
  kernels-community/flash-attn4 on NVIDIA Blackwell (compute capability 10 and up),
  kernels-community/flash-attn3 on other NVIDIA GPUs. It downloads into the Hub cache once;
  with `HF_HUB_OFFLINE=1` only the cache is read;
- an installed `flash_attn` package;
- PyTorch's own flash-attention op (`torch.ops.aten._flash_attention_forward`, CUDA), whose
  kernels are FlashAttention 4's where it is installed (`flash_impl`);
- otherwise none, and rows keep the FlexAttention tree path.

A kernel that cannot be had (the `kernels` library missing, offline, no build for this GPU, or
a Hub kernel failing a small forward+backward probe at load) is reported in one log line and
the next is tried: never a hard failure. Every kernel is called
with flash-attn's keyword names (`cu_seqlens_q`, `max_seqlen_q`, ...), which the flash-attn
2/3/4 and aiter interfaces share while their positional orders differ.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo_agent.train import flash_impl
from grpo_agent.train.packing import PackedRow
from grpo_agent.train.transfer import to_device

log = logging.getLogger(__name__)

KERNEL_ENV = "GRPO_AGENT_FLASH_KERNEL"
HALF_DTYPES = (torch.float16, torch.bfloat16)
# The spec's attention kernels on the Hub, by GPU type.
HUB_KERNELS = {
    "rocm": "kernels-community/aiter-flash-attn",
    "blackwell": "kernels-community/flash-attn4",
    "nvidia": "kernels-community/flash-attn3",
}


@functools.cache
def varlen_kernel() -> Callable | None:
    """`flash_attn_varlen_func` of the configured, spec's Hub, installed or built-in kernel."""
    spec = os.environ.get(KERNEL_ENV, "").strip()
    return ((spec and load_varlen_kernel(spec)) or load_hub_kernel(hub_kernel_repo())
            or load_varlen_kernel("") or torch_builtin_kernel())


def hub_kernel_repo() -> str | None:
    """The spec's Hub kernel for this machine's GPU; None without CUDA (or ROCm)."""
    if not torch.cuda.is_available():
        return None
    if torch.version.hip:
        return HUB_KERNELS["rocm"]
    major, _ = torch.cuda.get_device_capability()
    return HUB_KERNELS["blackwell"] if major >= 10 else HUB_KERNELS["nvidia"]


def load_hub_kernel(repo_id: str | None) -> Callable | None:
    """`repo_id`'s varlen function through `kernels.get_kernel`, or None with one log line."""
    if repo_id is None:
        return None
    try:
        import kernels
        from transformers.integrations.hub_kernels import get_attn_kernel_version

        kernel = kernels.get_kernel(
            repo_id, version=get_attn_kernel_version(repo_id)
        ).flash_attn_varlen_func
        probe_kernel(kernel, probe_device())
        return kernel
    except Exception as exc:  # noqa: BLE001 -- not installed, offline, no build: fall back
        # The exception's text, never the exception: a handler that keeps records (pytest's
        # log capture) would keep its traceback, whose frames -- this is resolved inside the
        # first forward -- keep that step's activations and autograd graph alive (on a GPU,
        # AccumulateGrad nodes pinned to the default stream broke a later CUDA graph capture).
        log.warning(
            "Attention kernel %s could not be loaded (%s: %s); using the torch/flash_attn "
            "kernels instead. `pip install kernels` and allow a Hub download (or fill the "
            "cache once) to use it.", repo_id, type(exc).__name__, str(exc),
        )
        return None


def probe_device() -> torch.device:
    return torch.device("cuda")


def probe_kernel(kernel: Callable, device: torch.device) -> None:
    """One small bf16 forward+backward against `sdpa_varlen`: a build that loads but cannot
    run on this GPU (or answers wrongly) fails here, at load, instead of in the first step."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=gen).to(device, torch.bfloat16).requires_grad_()
               for n, h in ((6, 4), (10, 2), (10, 2)))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device)
                  for c in ([0, 2, 6], [0, 4, 10]))
    args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 4, "max_seqlen_k": 6,
            "softmax_scale": 0.125, "causal": True}
    out = kernel(q, k, v, **args)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    expected = sdpa_varlen(q.detach().float(), k.detach().float(), v.detach().float(), **args)
    if not torch.allclose(out.float(), expected, atol=3e-2, rtol=0):
        raise RuntimeError("its output differs from the reference attention on a probe")


def load_varlen_kernel(spec: str) -> Callable | None:
    """Load from `spec` (see the module docstring; "" = an installed flash_attn, if any)."""
    if not spec:
        try:
            return importlib.import_module("flash_attn").flash_attn_varlen_func
        except Exception as exc:  # noqa: BLE001 -- absent, or built for another torch/CUDA
            log.debug("no flash_attn package (%s)", str(exc))  # text: see load_hub_kernel
            return None
    try:
        return _from_kernels_library(spec).flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 -- any load failure: another path is correct
        log.warning(
            "%s=%r could not be loaded (%s); using the next tree-attention kernel. Unset it, or "
            "point it at a local kernel directory or a Hub repo as org/name@REVISION.",
            KERNEL_ENV,
            spec,
            str(exc),  # text: see load_hub_kernel
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


def torch_builtin_kernel() -> Callable | None:
    """PyTorch's flash-attention varlen kernel, where this torch build has one (CUDA)."""
    if not torch.backends.cuda.is_flash_attention_available():
        return None
    flash_impl.torch_flash_impl()
    return torch_flash_varlen


def torch_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale=None, causal=False):
    """`flash_attn_varlen_func`'s contract on PyTorch's own kernel (differentiable; GQA when
    k/v have fewer heads; causal is aligned bottom-right, like flash-attn >= 2.1)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False,
        scale=softmax_scale,
    )
    return out[0]


def sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale=None, causal=False):
    """The same contract, one SDPA call per segment: the CPU kernel, and the reference that
    tests hold the flash kernels to. Causal is aligned bottom-right (the path's ancestors
    are visible to every query of the segment)."""
    q_lens, k_lens = (torch.diff(cu).tolist() for cu in (cu_seqlens_q, cu_seqlens_k))
    outs = []  # split, not slices: the backward is one concatenation, not S zero-filled copies
    for qs, ks, vs in zip(q.split(q_lens), k.split(k_lens), v.split(k_lens)):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (qs, ks, vs))  # 4-D: the fused kernels
        mask = None
        if causal and qs.shape[2] != ks.shape[2]:
            mask = torch.ones(qs.shape[2], ks.shape[2], dtype=torch.bool, device=q.device)
            mask = mask.tril(ks.shape[2] - qs.shape[2])
        outs.append(F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None,
            scale=softmax_scale, enable_gqa=qs.shape[1] != ks.shape[1],
        )[0].transpose(0, 1))
    return torch.cat(outs)


def flash_capable(device: torch.device) -> bool:
    """Flash kernels need an Ampere-or-newer GPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def row_is_unshared(segment_ancestors: torch.Tensor) -> bool:
    """True when every segment's only ancestor is itself (nothing in the row is shared)."""
    return int(segment_ancestors.sum()) == segment_ancestors.shape[0]


@dataclass
class VarlenPlan:
    """Segment bounds for the queries, path bounds for the gathered keys/values, and the kernel
    (resolved here, outside any compiled region)."""

    kernel: Callable
    cu_q: torch.Tensor  # int32 [S+1]: segment s's queries are row[cu_q[s]:cu_q[s+1]]
    cu_k: torch.Tensor  # int32 [S+1]: its keys are gathered[cu_k[s]:cu_k[s+1]]
    max_q: int
    max_k: int
    kv_index: torch.Tensor | None  # [sum of path lengths] row index of each gathered key

    @classmethod
    def build(cls, row: PackedRow, device, kernel: Callable) -> VarlenPlan:
        _, own_lens = torch.unique_consecutive(row.segment_ids, return_counts=True)
        path_lens = torch.tensor([len(p) for p in row.segment_paths])
        index = None
        if not row_is_unshared(row.segment_ancestors):
            index = torch.tensor([i for p in row.segment_paths for i in p])
        cu_q, cu_k, index = to_device(
            device,
            F.pad(own_lens.cumsum(0), (1, 0)).to(torch.int32),
            F.pad(path_lens.cumsum(0), (1, 0)).to(torch.int32),
            index,
        )
        return cls(
            kernel=kernel,
            cu_q=cu_q,
            cu_k=cu_k,
            max_q=int(own_lens.max()),
            max_k=int(path_lens.max()),
            kv_index=index,
        )


# dtype the gather's backward sums repeated rows in; None: the gradient's own dtype.
GATHER_GRAD_DTYPE: torch.dtype | None = torch.float32


class _GatherRows(torch.autograd.Function):
    """`x[index]` whose backward sums repeated rows in GATHER_GRAD_DTYPE (a prompt shared by G
    completions receives G gradients; bf16 atomics round after every add: the error and time
    of both are in docs/performance.md)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        dtype = GATHER_GRAD_DTYPE or grad.dtype
        total = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=dtype)
        total.index_add_(0, index, grad.to(dtype))
        return total.to(grad.dtype), None


def tree_varlen_attention(query, key, value, plan: VarlenPlan, scaling) -> torch.Tensor:
    """Tree attention in one kernel call; inputs [1, heads, N, dim], output [1, N, heads, dim]."""
    # [N, heads, dim] views: the kernels need a contiguous last dimension only
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if plan.kv_index is not None:
        k, v = _GatherRows.apply(k, plan.kv_index), _GatherRows.apply(v, plan.kv_index)
    out = plan.kernel(
        q, k, v, cu_seqlens_q=plan.cu_q, cu_seqlens_k=plan.cu_k, max_seqlen_q=plan.max_q,
        max_seqlen_k=plan.max_k, softmax_scale=scaling, causal=True,
    )
    if isinstance(out, tuple):  # flash-attn 3 also returns the log-sum-exp
        out = out[0]
    return out[None]
