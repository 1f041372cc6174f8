"""Kernels for Gated DeltaNet layers on tree-packed rows: path convolution and varlen delta rule.

Design decision: both kernels take the trie's structure as plain index tensors built once per
row (`gated_deltanet.DeltaPlan`), so they know nothing about tries:
- `path_conv`: the depthwise causal convolution where tap j of token i reads the token j steps
  before it *along its own sample* (an index table [N, K]; a missing predecessor reads zero).
  A custom autograd function saves only the input, not one gathered copy per tap.
- `chunk_delta_rule`: the chunked gated delta rule over several sequences at once (varlen,
  `cu_seqlens`), each starting from its own initial state and returning its final state, so a
  depth of the trie is one call. The torch version pads the sequences into a batch (zero
  keys, beta 0 and decay 0 past a sequence's end leave its state unchanged, so padding is
  exact) and runs the WY-form chunk algorithm of the Gated DeltaNet paper; on CUDA
  flash-linear-attention's `chunk_gated_delta_rule` (same contract) runs when importable.
The recurrence, per head with state S [Dk, Dv]: S <- exp(g_t) S; S <- S + beta_t k_t (v_t -
S^T k_t)^T; o_t = S^T q_t, with q, k L2-normalised and q scaled by Dk^-1/2.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CHUNK = 64


class _PathConv(torch.autograd.Function):
    """out[:, i] = sum_j w[:, j] x[:, taps[i, j]] (+ bias); column N of x is an implicit zero."""

    @staticmethod
    def forward(ctx, x, weight, bias, taps):
        # x [N, C], weight [C, K], taps [N, K] long with N meaning "no predecessor".
        # Sums run in float32 (as cuDNN's half-precision convolution accumulates).
        work = torch.promote_types(weight.dtype, torch.float32)
        padded, w = F.pad(x, (0, 0, 0, 1)).to(work), weight.to(work)
        out = padded.index_select(0, taps[:, 0]) * w[:, 0]
        for j in range(1, taps.shape[1]):
            out = out + padded.index_select(0, taps[:, j]) * w[:, j]
        if bias is not None:
            out = out + bias.to(work)
        ctx.save_for_backward(x, weight, taps)
        ctx.has_bias = bias is not None
        return out.to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, taps = ctx.saved_tensors
        work = torch.promote_types(weight.dtype, torch.float32)
        padded, w, grad = F.pad(x, (0, 0, 0, 1)).to(work), weight.to(work), grad.to(work)
        grad_x = torch.zeros_like(padded)
        grad_w = torch.empty_like(w)
        for j in range(taps.shape[1]):
            grad_x.index_add_(0, taps[:, j], grad * w[:, j])
            grad_w[:, j] = (grad * padded.index_select(0, taps[:, j])).sum(0)
        grad_b = grad.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x[:-1].to(x.dtype), grad_w.to(weight.dtype), grad_b, None


def path_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              taps: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution along trie paths: x [N, C] -> [N, C] (weight's dtype)."""
    return _PathConv.apply(x.to(weight.dtype), weight, bias, taps)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def torch_chunk_delta_rule(q, k, v, g, beta, initial_state, pad_index, batch, length,
                           want_final: bool):
    """Varlen gated delta rule in torch. q, k [T, H, Dk] (already L2-normalised, q scaled),
    v [T, H, Dv], g, beta [T, H]; `pad_index` [B*L] picks each sequence's rows into a padded
    [B, L] batch (T means padding); initial_state [B, H, Dk, Dv] or None.
    Returns outputs [T, H, Dv] (float32) and final states [B, H, Dk, Dv] (or None)."""
    def padded(x):
        x = F.pad(x.float(), (0, 0) * (x.dim() - 1) + (0, 1))
        return x.index_select(0, pad_index).unflatten(0, (batch, length)).transpose(1, 2)

    q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))  # [B, H, L, ...]
    chunks = length // CHUNK
    q, k, v = (x.unflatten(2, (chunks, CHUNK)) for x in (q, k, v))  # [B, H, n, C, D]
    g, beta = (x.unflatten(2, (chunks, CHUNK)) for x in (g, beta))  # [B, H, n, C]
    decay = g.cumsum(-1)  # log decay from the chunk's start up to and including t
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # WY form: (I + strictly-lower(beta_i k_i.k_j decay_ij)) [u | w] = [beta v | beta k e^decay]
    system = (k_beta @ k.transpose(-1, -2)) * pair
    rhs = torch.cat([v * beta[..., None], k_beta * decay.exp()[..., None]], -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], -1)
    inner = (q @ k.transpose(-1, -2)) * pair  # causal scores within the chunk, diagonal included
    q_read = q * decay.exp()[..., None]
    k_write = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = (initial_state.float() if initial_state is not None else
             q.new_zeros(batch, q.shape[1], k.shape[-1], v.shape[-1]))
    outs = []
    for c in range(chunks):
        new_v = u[:, :, c] - w[:, :, c] @ state
        outs.append(q_read[:, :, c] @ state + inner[:, :, c] @ new_v)
        state = state * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ new_v
    out = torch.stack(outs, 2).flatten(2, 3).transpose(1, 2).flatten(0, 1)  # [B*L, H, Dv]
    return out, (state if want_final else None)


@functools.cache
def fla_chunk_rule():
    """flash-linear-attention's varlen chunk kernel, or None (not installed, or no CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as error:  # noqa: BLE001 - any import failure means "use torch"
        logger.info("flash-linear-attention not importable (%s): torch delta rule.", error)
        return None
    problem = _fla_backward_problem()
    if problem:
        logger.warning("flash-linear-attention present but %s: torch delta rule.", problem)
        return None
    return chunk_gated_delta_rule


def _fla_backward_problem() -> str | None:
    """fla 0.6 refuses its gated backward on Hopper with Triton >= 3.4, < 3.7.1 (wrong results,
    fla issue #640) unless tilelang is installed; it raises only in the backward, so check
    before the first step instead of failing mid-training."""
    import importlib.util

    import triton

    if torch.cuda.get_device_capability()[0] != 9 or importlib.util.find_spec("tilelang"):
        return None
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3])
    if (3, 4, 0) <= version < (3, 7, 1):
        return f"Triton {triton.__version__} on Hopper miscomputes its backward (fla #640)"
    return None


@functools.cache
def announce(kernel: str) -> None:
    """One log line per process saying which Gated DeltaNet kernel runs."""
    logger.warning("Gated DeltaNet tree packing: %s chunked delta rule, torch path convolution.",
                   kernel)
