"""GRPO losses for the async trainer: masked importance sampling with score centering
(default) or the clipped surrogate, as pure functions over per-token tensors.

Design decision: the losses return token SUMS; the caller divides by the number of trained
tokens of the whole micro-batch across processes (the spec's normalisation), which is the only
way rows on different processes add up to one token mean. `row_loss` does that division and
is the trainer's single entry point per packed row.

Score centering (spec, "Compute the loss"): with r_v = pi(v)/mu(v) and f(r) = r inside
[C_min, C_max] and 0 outside (no gradient through f), the surrogate

    L_t = -A * ( f(r_o) * log pi(o) - sum_{v in S_t} mu(v) * f(r_v) * log pi(v) )

has the spec's gradient. S_t is the sampler's top `num_sampler_logprobs` ids at position t,
and mu(v) is the sampler's probability, NOT renormalised over S_t: the sum is the part of
the expectation the sampler reported (its mass is logged as `sampling/sampler_mass`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_agent.train.forward import forward_hidden, forward_row, is_moe
from grpo_agent.train.packing import PackedRow, pack_row
from grpo_agent.train.transfer import to_device
from grpo_agent.types import TrainingSample, TrainingSequence


@dataclass(frozen=True)
class LossConfig:
    temperature: float = 1.0
    score_centering: bool = True
    clip_min: float = 0.5
    clip_max: float = 5.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    router_aux_loss_coef: float = 0.0


def build_loss_config(config, model=None) -> LossConfig:
    """LossConfig from an AsyncGRPOConfig; a None aux coefficient takes the model config's."""
    coef = config.router_aux_loss_coef
    if coef is None:
        coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0) or 0.0
    return LossConfig(
        temperature=config.temperature,
        score_centering=config.score_centering,
        clip_min=config.vllm_importance_sampling_clip_min,
        clip_max=config.vllm_importance_sampling_clip_max,
        epsilon=config.epsilon,
        epsilon_high=config.effective_epsilon_high,
        router_aux_loss_coef=float(coef),
    )


@dataclass
class LossInputs:
    """Per trained token (T of them); top-k tensors are [T, K] with -inf sampler padding."""

    logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    # the token's sample, numbered 0..K-1 over samples with tokens (metrics only)
    token_sample: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    sampler_topk_logprobs: torch.Tensor | None = None


def importance_ratio(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp(logprobs - sampler_logprobs)


def in_clip_range(ratio: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    ratio = ratio.detach()
    return (ratio >= cfg.clip_min) & (ratio <= cfg.clip_max)


def _masked_ratio_weight(ratio: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """f(r) = r inside [C_min, C_max], 0 outside; a constant (no gradient)."""
    ratio = ratio.detach()
    return torch.where(in_clip_range(ratio, cfg), ratio, torch.zeros_like(ratio))


def score_centering_loss(inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    """Sum over tokens of the score-centred surrogate (see the module docstring)."""
    f_o = _masked_ratio_weight(importance_ratio(inp.logprobs, inp.sampler_logprobs), cfg)
    per_token = f_o * inp.logprobs
    if inp.topk_logprobs is not None:
        present = torch.isfinite(inp.sampler_topk_logprobs)
        mu = torch.exp(inp.sampler_topk_logprobs).masked_fill(~present, 0.0)
        sampler_lp = inp.sampler_topk_logprobs.masked_fill(~present, 0.0)
        f_v = _masked_ratio_weight(importance_ratio(inp.topk_logprobs, sampler_lp), cfg)
        f_v = f_v.masked_fill(~present, 0.0)
        topk_logprobs = inp.topk_logprobs.masked_fill(~present, 0.0)
        per_token = per_token - (mu * f_v * topk_logprobs).sum(-1)
    return -(inp.advantages * per_token).sum()


def clipped_surrogate_loss(inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    """Sum over tokens of the masked, clipped GRPO surrogate (score_centering=False)."""
    ratio = importance_ratio(inp.logprobs, inp.sampler_logprobs)
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    surrogate = torch.minimum(ratio * inp.advantages, clipped * inp.advantages)
    return -(surrogate * in_clip_range(ratio, cfg)).sum()


def policy_loss(inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    return (
        score_centering_loss(inp, cfg) if cfg.score_centering else clipped_surrogate_loss(inp, cfg)
    )


def padded_policy_loss(cfg: LossConfig):
    """`policy_loss` as a row graph's loss function (`row_graphs.LossFn`): over a bucket's
    padded trained entries, whose advantage is 0 (and sampler top-k -inf), so padding adds
    nothing to the loss or to any gradient."""
    def loss(token, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return policy_loss(LossInputs(
            logprobs=token.logprobs, sampler_logprobs=tensors["sampler_logprobs"],
            advantages=tensors["advantages"], topk_logprobs=token.topk_logprobs,
            sampler_topk_logprobs=tensors.get("sampler_topk_logprobs"),
        ), cfg)
    return loss


# Every metric `row_loss` can return, in a fixed order: processes reduce them by position.
LOSS_METRIC_NAMES = (
    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max", "sampling/masked_mean", "sampling/sampler_mass",
    "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
    "clip_ratio/low_min", "clip_ratio/high_max", "aux_loss",
)


def loss_metrics(
    inp: LossInputs, cfg: LossConfig, entropy: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The spec's sampling/*, clip_ratio/* and entropy metrics over one row's trained tokens,
    as 0-d tensors on the loss's device: reading them waits for the GPU, so the trainer reads
    them once per optimizer step, over all processes (`step_rows`)."""
    if inp.logprobs.numel() == 0:
        return {}
    with torch.no_grad():
        logp, adv = inp.logprobs.detach(), inp.advantages
        ratio = importance_ratio(logp, inp.sampler_logprobs)
        diff = (logp - inp.sampler_logprobs).abs()
        low = ratio < 1 - cfg.epsilon
        high = ratio > 1 + cfg.epsilon_high
        if not cfg.score_centering:  # where the surrogate's clip actually binds
            low, high = low & (adv < 0), high & (adv > 0)
        low_frac, high_frac, has_tokens = _per_sample_fractions(low, high, inp.token_sample)
        metrics = {
            "sampling/sampling_logp_difference/mean": diff.mean(),
            "sampling/sampling_logp_difference/max": diff.max(),
            "sampling/importance_sampling_ratio/min": ratio.min(),
            "sampling/importance_sampling_ratio/mean": ratio.mean(),
            "sampling/importance_sampling_ratio/max": ratio.max(),
            "sampling/masked_mean": (~in_clip_range(ratio, cfg)).float().mean(),
            "entropy": entropy.float().mean(),
            "clip_ratio/low_mean": low.float().mean(),
            "clip_ratio/high_mean": high.float().mean(),
            "clip_ratio/region_mean": (low | high).float().mean(),
            "clip_ratio/low_min": torch.where(has_tokens, low_frac, torch.inf).min(),
            "clip_ratio/high_max": torch.where(has_tokens, high_frac, -torch.inf).max(),
        }
        if cfg.score_centering and inp.sampler_topk_logprobs is not None:
            mass = torch.exp(inp.sampler_topk_logprobs).sum(-1)  # exp(-inf) = 0 at padding
            metrics["sampling/sampler_mass"] = mass.mean()
    return metrics


def metric_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One row's metrics as plain numbers, read from the device in one transfer."""
    flat = [v.detach().float().reshape(()) for v in metrics.values()]
    return dict(zip(metrics, torch.stack(flat).tolist() if flat else []))


def _per_sample_fractions(low: torch.Tensor, high: torch.Tensor, token_sample: torch.Tensor):
    """Per sample of the row: fraction of its tokens low- and high-clipped, and whether it has
    trained tokens at all; on the flags' device, without reading anything back."""
    n = token_sample.shape[0]  # bounds the (dense) sample numbers without reading them back
    per_token = torch.stack([torch.ones_like(low), low, high], dim=1).float()
    sums = torch.zeros(n, 3, device=low.device).index_add_(0, token_sample.to(low.device),
                                                         per_token)
    counts = sums[:, 0]
    fractions = sums[:, 1:] / counts.clamp(min=1)[:, None]
    return fractions[:, 0], fractions[:, 1], counts > 0


def dense_token_samples(row: PackedRow) -> torch.Tensor:
    """Each trained token's sample numbered 0..K-1 over the row's samples with tokens (CPU):
    what `LossInputs.token_sample` holds for the per-sample clip metrics."""
    return torch.unique(row.token_sample, return_inverse=True)[1]


def row_loss(
    model, row: PackedRow, cfg: LossConfig, num_trained_tokens_global: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one packed row, normalised by the micro-batch's trained tokens on all processes,
    and its metrics as device tensors (the trainer reads them once per step: `step_rows`).

    Backward this (divided by gradient_accumulation_steps, and multiplied by the number of
    processes when the gradient all-reduce averages) and sum over rows. An empty row still
    runs the model on one token, so every process joins the same collectives.
    """
    if num_trained_tokens_global <= 0:
        raise ValueError(
            "num_trained_tokens_global must be positive (the micro-batch trains nothing)."
        )
    if row.num_trained == 0:
        return _zero_loss(model, row), {}
    with_aux = bool(cfg.router_aux_loss_coef) and bool(is_moe(model))
    # on the device before the forward is queued (see forward_row)
    sampler_logprobs, advantages, sampler_topk_logprobs, token_sample = to_device(
        next(model.parameters()).device, row.sampler_logprobs, row.advantages,
        row.sampler_topk_logprobs, dense_token_samples(row),
    )
    fwd = forward_row(model, row, temperature=cfg.temperature, with_aux_loss=with_aux)
    inp = LossInputs(
        logprobs=fwd.token.logprobs,
        sampler_logprobs=sampler_logprobs,
        advantages=advantages,
        token_sample=token_sample,
        topk_logprobs=fwd.token.topk_logprobs,
        sampler_topk_logprobs=sampler_topk_logprobs,
    )
    loss = policy_loss(inp, cfg) / num_trained_tokens_global
    metrics = loss_metrics(inp, cfg, fwd.token.entropy)
    if fwd.aux_loss is not None:
        share = row.num_trained / num_trained_tokens_global
        loss = loss + cfg.router_aux_loss_coef * fwd.aux_loss * share
        metrics["aux_loss"] = fwd.aux_loss.detach()
    return loss, metrics


def _zero_loss(model, row: PackedRow) -> torch.Tensor:
    """A zero that depends on every forward collective (FSDP) but changes no gradient."""
    if row.is_empty:
        filler = TrainingSequence(token_ids=[0], trained_mask=[0], sampler_logprobs=[0.0])
        sample = TrainingSample(
            sequence=filler, advantage=0.0, model_version=0, group_id=-1, row_index=-1
        )
        row = pack_row([sample])
    hidden, _ = forward_hidden(model, row)
    return hidden.sum() * 0.0 + model.get_output_embeddings().weight.sum() * 0.0
