"""Per-token log-probs without materialising [tokens x vocab] logits.

Design decision: log pi(v) = z_v / T - logsumexp(z / T). The two parts are computed apart:
the few logits we need (the trained target, the sampler's top-k ids) are gathered rows of the
LM head and go through ordinary autograd; the log-sum-exp over the vocabulary (or over the
sampling mask's candidates) is an `autograd.Function` that walks the vocabulary in tiles
and whose backward recomputes each tile (d lse / dz = softmax). Peak extra memory is one
[tokens x tile] block instead of [tokens x vocab]. The entropy of the same distribution comes
out of the forward pass for free (it is a metric: no gradient).

Each tile's element-wise work (scale, mask, max, exp-sums in the forward; the softmax
gradient in the backward) is one function of the tile's logits. On CUDA it is compiled
(`compiled_or_eager`), so the logits are read once in the matmul's own dtype instead of making
several float32 passes; the tiles' partial results (max, sum of exp, sum of exp * z) are
combined afterwards. Where compilation is unavailable, or on CPU (where compiling would only
slow tests down), the same functions run eagerly.

On CUDA in half precision without a sampling mask, the log-sum-exp and entropy come from the
fused Triton kernels of `fused_lm_head` instead (LM_HEAD="auto"; the logits never leave the
kernel's registers: 0.81-0.92x the tiles' time and 0.2 GiB less at 16k tokens on an H200,
docs/performance.md); the tiles stay the CPU path, the sampling-mask path and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_agent.train import fused_lm_head
from grpo_agent.train.compiled_or_eager import CompiledOrEager

DEFAULT_TILE_ELEMENTS = 2**26  # tile width x tokens (GPU)
# On CPU the per-tile element-wise passes run from memory unless a tile's logits fit the core's
# cache: 2 MiB of float32 took the tiny model's LM head (1,750 tokens x 2,048 ids, one thread)
# from 73 to 53 ms forward+backward against a 2**26 budget (all 14 MiB of logits in one tile).
CPU_TILE_ELEMENTS = 2**19
TILE_ALIGN = 256  # tile widths are multiples of this: the logits' row stride stays aligned
# "auto": the fused Triton kernels (`fused_lm_head`) where they can run (CUDA, half precision,
# Triton, no sampling mask), else the torch tiles below; "torch" forces the tiles.
LM_HEAD = "auto"
LM_HEAD_CHOICES = ("auto", "torch", "triton")


@dataclass
class TokenLogprobs:
    """Trainer log-probs for the trained tokens of one row."""

    logprobs: torch.Tensor  # [T] log pi(target), with grad
    entropy: torch.Tensor  # [T] no grad
    topk_logprobs: torch.Tensor | None = (
        None  # [T, K] log pi(sampler top ids), with grad; 0 at padding
    )


def _tile_allowed(candidates: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """[T, stop-start] bool: which vocabulary ids of the tile are in each row's candidate set."""
    width = stop - start
    rel = candidates - start
    valid = (candidates >= 0) & (rel >= 0) & (rel < width)
    counts = torch.zeros(candidates.shape[0], width, dtype=torch.int32, device=candidates.device)
    counts.scatter_add_(1, rel.clamp(0, width - 1), valid.to(torch.int32))
    return counts > 0


def _scaled_logits(raw, temperature: float, allowed):
    """float32 z / T of one tile, -inf where the sampling mask excludes an id."""
    z = raw.float()
    if temperature != 1.0:
        z = z / temperature
    if allowed is not None:
        z = z.masked_fill(~allowed, float("-inf"))
    return z


def _tile_stats(raw, temperature: float, allowed):
    """Per row of one tile: max z, sum exp(z - max), sum exp(z - max) * z.

    The last as sum e * (z - max) + max * sum e: a dot product over the shifted logits already
    at hand, with no [tokens x tile] product or `where` pass unless a mask put -inf in them."""
    z = _scaled_logits(raw, temperature, allowed)
    tile_max = z.amax(dim=1)
    safe_max = torch.where(torch.isfinite(tile_max), tile_max, torch.zeros_like(tile_max))
    shifted = z - safe_max[:, None]
    e = shifted.exp()
    if allowed is not None:  # e is 0 at -inf: avoid 0 * -inf
        shifted = torch.where(e > 0, shifted, torch.zeros_like(shifted))
    total = e.sum(dim=1)
    return tile_max, total, torch.linalg.vecdot(e, shifted) + safe_max * total


def _tile_grad(raw, temperature: float, allowed, lse, scale):
    """d lse / d(raw logits) of one tile, times the incoming gradient: softmax * grad / T."""
    z = _scaled_logits(raw, temperature, allowed)
    return z.sub(lse[:, None]).exp_().mul_(scale[:, None]).to(raw.dtype)


tile_stats = CompiledOrEager(_tile_stats)
tile_grad = CompiledOrEager(_tile_grad)


def _combine_tiles(maxes, sums, sums_z):
    """Merge per-tile (max, sum exp, sum exp * z) into (lse, entropy) per row."""
    maxes, sums, sums_z = torch.stack(maxes), torch.stack(sums), torch.stack(sums_z)
    run_max = maxes.amax(dim=0)
    safe_max = torch.where(torch.isfinite(run_max), run_max, torch.zeros_like(run_max))
    rescale = torch.exp(maxes - safe_max)
    total = (sums * rescale).sum(dim=0)
    lse = safe_max + torch.log(total)
    entropy = lse - (sums_z * rescale).sum(dim=0) / total
    return lse, entropy


def _tiles(vocab: int, tile: int):
    return [(start, min(start + tile, vocab)) for start in range(0, vocab, tile)]


class _TiledLogSumExp(torch.autograd.Function):
    """lse_t = logsumexp_v (h_t . w_v / T) over the vocabulary (or candidates), in tiles."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature, tile, candidates):
        parts = ([], [], [])
        for start, stop in _tiles(weight.shape[0], tile):
            allowed = None if candidates is None else _tile_allowed(candidates, start, stop)
            for acc, value in zip(
                parts, tile_stats(hidden @ weight[start:stop].T, temperature, allowed)
            ):
                acc.append(value)
        lse, entropy = _combine_tiles(*parts)
        ctx.save_for_backward(hidden, weight, lse, candidates)
        ctx.temperature, ctx.tile = temperature, tile
        ctx.mark_non_differentiable(entropy)
        return lse, entropy

    @staticmethod
    def backward(ctx, grad_lse, _grad_entropy):
        hidden, weight, lse, candidates = ctx.saved_tensors
        scale = grad_lse / ctx.temperature
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start, stop in _tiles(weight.shape[0], ctx.tile):
            allowed = None if candidates is None else _tile_allowed(candidates, start, stop)
            raw = hidden @ weight[start:stop].T
            grad_z = tile_grad(raw, ctx.temperature, allowed, lse, scale)
            grad_hidden += (grad_z @ weight[start:stop]).float()
            if grad_weight is not None:
                grad_weight[start:stop] = grad_z.T @ hidden
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None


def default_tile_width(tokens: int, device_type: str = "cuda") -> int:
    """About DEFAULT_TILE_ELEMENTS per tile (CPU_TILE_ELEMENTS on CPU), rounded down to a
    multiple of TILE_ALIGN.

    An unaligned width gives the [tokens x tile] logits an odd row stride, and cuBLAS then
    falls back to slow unaligned GEMM kernels (seen on H200: 5x slower LM-head matmuls)."""
    budget = CPU_TILE_ELEMENTS if device_type == "cpu" else DEFAULT_TILE_ELEMENTS
    width = budget // max(1, tokens)
    return max(TILE_ALIGN, width - width % TILE_ALIGN)


def tiled_log_sum_exp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float = 1.0,
    candidates: torch.Tensor | None = None,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [T] with grad, entropy [T]) of softmax(hidden @ weight.T / temperature)."""
    if tile is None:
        tile = default_tile_width(hidden.shape[0], hidden.device.type)
    if candidates is None and use_fused_kernels(hidden, weight):
        return fused_lm_head.FusedLogSumExp.apply(hidden, weight, float(temperature), int(tile))
    return _TiledLogSumExp.apply(hidden, weight, float(temperature), int(tile), candidates)


def use_fused_kernels(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """LM_HEAD's choice for these tensors; "triton" where the kernels cannot run is an error."""
    if LM_HEAD not in LM_HEAD_CHOICES:
        raise ValueError(f"logprobs.LM_HEAD={LM_HEAD!r}: choose one of {LM_HEAD_CHOICES}.")
    if LM_HEAD == "torch":
        return False
    usable = fused_lm_head.usable(hidden, weight)
    if LM_HEAD == "triton" and not usable:
        raise ValueError(
            "logprobs.LM_HEAD='triton' needs CUDA half-precision tensors and Triton; "
            "use 'auto' to fall back to the torch tiles."
        )
    return usable


def gathered_logits(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float
):
    """z[t, k] = h_t . w_{ids[t, k]} / T for a few ids per row ([T] or [T, K]); -1 ids give 0."""
    safe = ids.clamp(min=0)
    if ids.dim() == 1:
        return (hidden * weight[safe]).sum(-1).float() / temperature
    return torch.einsum("th,tkh->tk", hidden, weight[safe]).float() / temperature


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    topk_ids: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    tile: int | None = None,
) -> TokenLogprobs:
    """Log-probs of `targets` (and of `topk_ids`) under the temperature-scaled LM head.

    `hidden` holds the hidden state of the position that predicts each target. With
    `candidates` ([T, M] ids, -1 padding), the distribution is renormalised over that set,
    as the sampler did under top-k/top-p.
    """
    lse, entropy = tiled_log_sum_exp(hidden, weight, temperature, candidates, tile)
    logprobs = gathered_logits(hidden, weight, targets, temperature) - lse
    topk = None
    if topk_ids is not None:
        topk = gathered_logits(hidden, weight, topk_ids, temperature) - lse[:, None]
        topk = topk.masked_fill(topk_ids < 0, 0.0)
    return TokenLogprobs(logprobs=logprobs, entropy=entropy, topk_logprobs=topk)


def naive_token_logprobs(hidden, weight, targets, temperature=1.0) -> torch.Tensor:
    """Reference path that materialises full logits (tests and the memory benchmark)."""
    logits = (hidden @ weight.T).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
