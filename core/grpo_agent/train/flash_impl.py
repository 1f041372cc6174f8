"""Which kernels torch's own flash-attention ops run: FlashAttention 4 where it is installed.

Design decision: both tree-attention paths on CUDA call torch's flash ops
(`aten._flash_attention_forward/backward`: the varlen path once per layer, the level path once
per depth part). torch >= 2.11 can route those ops to FlashAttention 4's CuTe DSL kernels
(`torch.nn.attention.activate_flash_attention_impl("FA4")`, Hopper and Blackwell), which
torch.compile and the level op's custom-op wrapper then call like the built-in kernel. On an
H100 they took 0.73-0.88 of the built-in kernel's forward+backward time on tree rows
(`bench/varlen_kernels.py`), and the compiled 1.7B step at 16k-token rows went from 0.441-0.449
(earlier runs) to 0.477 MFU. But each call costs about 0.6 ms of Python on the host, so where the host sets the
pace (6k-token rows without CUDA graphs) the step got 13% slower; with CUDA graphs (no host
work per replay) the same rows got 11% faster, and the trainer's own step at 8k-token rows,
GPU-bound there, 6-8% faster (docs/performance.md). So `auto` activates them
where `pip install flash-attn-4` put them, a small forward+backward probe agrees with SDPA,
and the trainer's rows may reach `FA4_MIN_TOKENS` or replay CUDA graphs (`expect_rows`; unknown
counts as long).
The first call of each kernel shape compiles it (seconds, cached on disk by the CuTe DSL).

`GRPO_AGENT_FLASH_IMPL`: `auto` (default), `FA4` (for any rows: an error if it cannot run),
or `default` (torch's built-in kernels). Resolved once per process, at the first CUDA
half-precision row, never at import, unless `use()` chose first (benches switching between
the two); one implementation serves a whole run (a forward and its backward must run the
same one).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

IMPL_ENV = "GRPO_AGENT_FLASH_IMPL"
CHOICES = ("auto", "FA4", "default")
FA4_MODULE = "flash_attn.cute"  # what `pip install flash-attn-4` installs
FA4_CAPABILITIES = (9, 10)  # Hopper, Blackwell: what torch's FA4 bridge accepts
# `auto` takes FA4 for token budgets of this many tokens or more: GPU-bound there (on an H100
# faster in the trainer's step at 8k-token rows and in the MFU bench at 15-16k, slower in an
# isolated 6k-token row without CUDA graphs: docs/performance.md).
FA4_MIN_TOKENS = 8192
_expected_row_tokens: int | None = None
_chosen: str | None = None  # set by the first torch_flash_impl() or any explicit use()


def expect_rows(tokens: int, replayed: bool = False) -> None:
    """The longest rows this process will train on (the trainer's token budget). `replayed`:
    its rows replay CUDA graphs (`cuda_graphs`), where FA4's host cost is paid at capture
    only, so rows of any length count as GPU-bound."""
    global _expected_row_tokens
    _expected_row_tokens = None if replayed else tokens


def wanted(environ: Mapping[str, str] = os.environ) -> str:
    text = environ.get(IMPL_ENV, "").strip() or "auto"
    for choice in CHOICES:
        if text.lower() == choice.lower():
            return choice
    raise ValueError(f"{IMPL_ENV}={text!r}: choose one of {', '.join(CHOICES)}.")


def fa4_kernels_missing(device: torch.device) -> str | None:
    """Why FlashAttention 4's own kernels cannot run here; None if they can be tried."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_CAPABILITIES:
        return f"compute capability {major}.{minor} (FlashAttention 4 needs 9.x or 10.x)"
    if importlib.util.find_spec(FA4_MODULE.split(".")[0]) is None or \
            importlib.util.find_spec(FA4_MODULE) is None:
        return "flash-attn-4 is not installed (pip install flash-attn-4)"
    return None


def fa4_missing(device: torch.device) -> str | None:
    """Why FlashAttention 4 cannot serve torch's flash ops here; None if it can be tried."""
    missing = fa4_kernels_missing(device)
    if missing:
        return missing
    try:
        from torch.nn import attention
    except ImportError:
        return "this torch has no torch.nn.attention"
    if not hasattr(attention, "activate_flash_attention_impl"):
        return f"torch {torch.__version__} cannot route its flash ops to another implementation"
    if not hasattr(getattr(attention, "_fa4", None), "register_flash_attention_fa4"):
        return f"torch {torch.__version__} has no FA4 bridge"
    return None


def active() -> str:
    """"FA4" while torch's flash ops run FlashAttention 4, else "default"."""
    from torch.nn import attention

    current = getattr(attention, "current_flash_attention_impl", lambda: None)()
    return current or "default"


def use(name: str, device: torch.device | None = None) -> None:
    """Route torch's flash ops to FlashAttention 4 ("FA4", after its probe passes) or back to
    torch's own kernels ("default"); raises RuntimeError naming why FA4 cannot run."""
    global _chosen
    from torch.nn import attention

    if name == "default":
        attention.restore_flash_attention_impl(_raise_warn=False)
        _chosen = "default"
        return
    device = device or torch.device("cuda")
    missing = fa4_missing(device)
    if missing:
        raise RuntimeError(missing)
    # torch's bridge imports the module it is given and calls its `_flash_attn_fwd/_bwd`: this
    # module's, which adapt FlashAttention 4's to what the bridge unpacks.
    attention._registry.register_flash_attention_impl(
        "FA4", register_fn=functools.partial(attention._fa4.register_flash_attention_fa4, __name__))
    attention.activate_flash_attention_impl("FA4")
    try:
        probe(device)
    except Exception as exc:
        attention.restore_flash_attention_impl(_raise_warn=False)
        raise RuntimeError(f"its probe failed ({type(exc).__name__}: {str(exc)[:200]})") from exc
    _chosen = "FA4"


def _flash_attn_fwd(*args, **kwargs):
    """FlashAttention 4's forward as torch 2.11's bridge unpacks it: (out, lse). FA4 4.0.0b36
    also returns the sparse-MLA forward's extras (p, row_max, o_lo), None here."""
    from flash_attn.cute import interface

    return tuple(interface._flash_attn_fwd(*args, **kwargs)[:2])


def _flash_attn_bwd(*args, **kwargs):
    """FlashAttention 4's backward as the bridge unpacks it: (dq, dk, dv)."""
    from flash_attn.cute import interface

    return tuple(interface._flash_attn_bwd(*args, **kwargs)[:3])


def probe(device: torch.device) -> None:
    """One bf16 causal varlen forward+backward (a 4-query segment against 6 keys, GQA, head
    dims 64 and 128) through torch's flash op against SDPA in float32."""
    gen = torch.Generator().manual_seed(0)
    for dim in (64, 128):
        q, k, v = (torch.randn(n, h, dim, generator=gen).to(device, torch.bfloat16)
                   .requires_grad_() for n, h in ((4, 4), (6, 2), (6, 2)))
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in ([0, 4], [0, 6]))
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 4, 6, 0.0, True,
                                                      False, scale=dim ** -0.5)[0]
        out.float().sum().backward()
        mask = torch.ones(4, 6, dtype=torch.bool, device=device).tril(2)
        expected = F.scaled_dot_product_attention(
            *(t.detach().float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
            scale=dim ** -0.5, enable_gqa=True)[0].transpose(0, 1)
        if not torch.allclose(out.float(), expected, atol=3e-2, rtol=0):
            raise RuntimeError(f"its output differs from SDPA's on a probe (head dim {dim})")
        if not all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v)):
            raise RuntimeError(f"its backward gave no finite gradients (head dim {dim})")


def torch_flash_impl() -> str:
    """"FA4" once torch's flash ops run FlashAttention 4 in this process, else "default";
    the first call chooses (see the module doc), later ones return that choice."""
    global _chosen
    if _chosen is None:
        _chosen = _choose()
    return _chosen


def _choose() -> str:
    choice = wanted()
    if choice == "default":
        return "default"
    if choice == "auto" and _expected_row_tokens is not None \
            and _expected_row_tokens < FA4_MIN_TOKENS:
        log.debug("torch's own flash kernels: rows of at most %d tokens are host-bound",
                  _expected_row_tokens)
        return "default"
    missing = fa4_missing(torch.device("cuda"))
    if missing is None:
        try:
            use("FA4")
        except RuntimeError as exc:  # installed but broken: say so
            log.warning("torch's own flash kernels: FlashAttention 4 cannot run (%s)", exc)
            if choice == "FA4":
                raise _required_but(str(exc)) from exc
            return "default"
        log.info("torch's flash attention ops run FlashAttention 4 (%s=default for torch's "
                 "own kernels)", IMPL_ENV)
        return "FA4"
    if choice == "FA4":
        raise _required_but(missing)
    log.debug("torch's own flash kernels: FlashAttention 4 cannot run (%s)", missing)
    return "default"


def _required_but(why: str) -> RuntimeError:
    return RuntimeError(f"{IMPL_ENV}=FA4, but FlashAttention 4 cannot run: {why}. Install "
                        f"flash-attn-4 on a Hopper/Blackwell GPU, or set {IMPL_ENV}=auto.")
