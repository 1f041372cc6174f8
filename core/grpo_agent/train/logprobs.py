"""Per-token log-probs without materialising [tokens x vocab] logits.

Design decision: log pi(v) = z_v / T - logsumexp(z / T). The two parts are computed apart:
the few logits we need (the trained target, the sampler's top-k ids) are gathered rows of the
LM head and go through ordinary autograd; the log-sum-exp over the vocabulary (or over the
sampling mask's candidates) is an `autograd.Function` that walks the vocabulary in tiles with
an online max/sum, and whose backward recomputes each tile (d lse / dz = softmax). Peak extra
memory is one [tokens x tile] block instead of [tokens x vocab]. The entropy of the same
distribution comes out of the forward pass for free (it is a metric: no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TILE_ELEMENTS = 2**26  # ~256 MiB of float32 logits per tile


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


def _tile_logits(hidden, weight, start, stop, temperature, candidates):
    """float32 logits of one vocabulary tile (fresh tensor: callers may modify it in place)."""
    z = (hidden @ weight[start:stop].T).float()
    if temperature != 1.0:
        z.div_(temperature)
    if candidates is not None:
        z.masked_fill_(~_tile_allowed(candidates, start, stop), float("-inf"))
    return z


class _TiledLogSumExp(torch.autograd.Function):
    """lse_t = logsumexp_v (h_t . w_v / T) over the vocabulary (or candidates), in tiles."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature, tile, candidates):
        rows = hidden.shape[0]
        run_max = torch.full((rows,), float("-inf"), device=hidden.device)
        run_sum = torch.zeros(rows, device=hidden.device)
        run_sum_z = torch.zeros(rows, device=hidden.device)  # sum exp(z - max) * z, for entropy
        for start in range(0, weight.shape[0], tile):
            z = _tile_logits(
                hidden, weight, start, min(start + tile, weight.shape[0]), temperature, candidates
            )
            new_max = torch.maximum(run_max, z.max(dim=1).values)
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            rescale = torch.exp(run_max - safe_max)
            e = torch.sub(z, safe_max[:, None]).exp_()
            if candidates is not None:
                z.nan_to_num_(neginf=0.0)  # e is 0 there; avoid 0 * -inf
            run_sum = run_sum * rescale + e.sum(dim=1)
            run_sum_z = run_sum_z * rescale + torch.einsum("tv,tv->t", e, z)
            run_max = new_max
        lse = run_max + torch.log(run_sum)
        entropy = lse - run_sum_z / run_sum
        ctx.save_for_backward(hidden, weight, lse, candidates)
        ctx.temperature, ctx.tile = temperature, tile
        ctx.mark_non_differentiable(entropy)
        return lse, entropy

    @staticmethod
    def backward(ctx, grad_lse, _grad_entropy):
        hidden, weight, lse, candidates = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, weight.shape[0], ctx.tile):
            stop = min(start + ctx.tile, weight.shape[0])
            z = _tile_logits(hidden, weight, start, stop, ctx.temperature, candidates)
            z.sub_(lse[:, None]).exp_().mul_(grad_lse[:, None] / ctx.temperature)
            grad_z = z.to(hidden.dtype)
            grad_hidden += (grad_z @ weight[start:stop]).float()
            if grad_weight is not None:
                grad_weight[start:stop] = grad_z.T @ hidden
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None


def tiled_log_sum_exp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float = 1.0,
    candidates: torch.Tensor | None = None,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [T] with grad, entropy [T]) of softmax(hidden @ weight.T / temperature)."""
    if tile is None:
        tile = max(256, DEFAULT_TILE_ELEMENTS // max(1, hidden.shape[0]))
    return _TiledLogSumExp.apply(hidden, weight, float(temperature), int(tile), candidates)


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
