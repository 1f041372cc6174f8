"""Losses: score-centering gradient vs its closed form, the clipped surrogate vs a direct
implementation of the spec's formula, metrics, and row_loss on a real tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train.forward import forward_row
from grpo_agent.train.loss import (
    LossConfig,
    LossInputs,
    build_loss_config,
    clipped_surrogate_loss,
    loss_metrics,
    metric_floats,
    row_loss,
    score_centering_loss,
)
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import enable_tree_attention

P, V, K = 6, 10, 4


def _toy(cfg: LossConfig):
    """A categorical policy per position (logits theta) and a sampler mu near it."""
    theta = torch.randn(P, V, dtype=torch.float64, requires_grad=True)
    mu_logits = theta.detach() + torch.randn(P, V, dtype=torch.float64) * 0.8
    log_mu = torch.log_softmax(mu_logits, -1)
    sampled = torch.multinomial(log_mu.exp(), 1).squeeze(1)
    top_ids = log_mu.topk(K, dim=-1).indices
    adv = torch.randn(P, dtype=torch.float64)
    return theta, log_mu, sampled, top_ids, adv


def _inputs(theta, log_mu, sampled, top_ids, adv):
    logp = torch.log_softmax(theta, -1)
    return LossInputs(
        logprobs=logp.gather(1, sampled[:, None]).squeeze(1),
        sampler_logprobs=log_mu.gather(1, sampled[:, None]).squeeze(1),
        advantages=adv,
        token_sample=torch.arange(P) // 2,
        topk_logprobs=logp.gather(1, top_ids),
        sampler_topk_logprobs=log_mu.gather(1, top_ids),
    )


def test_score_centering_gradient_is_the_closed_form():
    cfg = LossConfig(clip_min=0.7, clip_max=1.6)
    theta, log_mu, sampled, top_ids, adv = _toy(cfg)
    loss = score_centering_loss(_inputs(theta, log_mu, sampled, top_ids, adv), cfg)
    (grad,) = torch.autograd.grad(loss, theta)

    pi = torch.softmax(theta.detach(), -1)
    ratio = pi / log_mu.exp()
    f = torch.where(
        (ratio >= cfg.clip_min) & (ratio <= cfg.clip_max), ratio, torch.zeros_like(ratio)
    )
    assert 0 < (f == 0).sum() < f.numel()  # both branches of f are exercised
    # and a sampled token outside the bounds, whose centering term still applies
    assert 0 < (f[torch.arange(P), sampled] == 0).sum() < P
    eye = torch.eye(V, dtype=torch.float64)
    expected = torch.zeros(P, V, dtype=torch.float64)
    for t in range(P):
        o = sampled[t]
        term = f[t, o] * (eye[o] - pi[t])
        for v in top_ids[t]:
            term = term - log_mu[t, v].exp() * f[t, v] * (eye[v] - pi[t])
        expected[t] = -adv[t] * term
    torch.testing.assert_close(grad, expected, atol=1e-10, rtol=1e-8)


def test_clipped_surrogate_equals_the_spec_formula():
    cfg = LossConfig(
        score_centering=False, clip_min=0.6, clip_max=1.8, epsilon=0.2, epsilon_high=0.28
    )
    theta, log_mu, sampled, top_ids, adv = _toy(cfg)
    inp = _inputs(theta, log_mu, sampled, top_ids, adv)
    got = clipped_surrogate_loss(inp, cfg) / P

    terms = []
    for t in range(P):
        r = torch.exp(inp.logprobs[t] - inp.sampler_logprobs[t])
        inside = cfg.clip_min <= r.item() <= cfg.clip_max
        clip = torch.clamp(r, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        terms.append(float(inside) * torch.minimum(r * adv[t], clip * adv[t]))
    expected = -torch.stack(terms).sum() / P
    torch.testing.assert_close(got, expected)
    g_got = torch.autograd.grad(got, theta, retain_graph=True)[0]
    g_ref = torch.autograd.grad(expected, theta)[0]
    torch.testing.assert_close(g_got, g_ref)


def test_metrics_names_and_values():
    cfg = LossConfig()
    inp = LossInputs(
        logprobs=torch.log(torch.tensor([0.5, 0.2, 0.9, 0.1])),
        sampler_logprobs=torch.log(torch.tensor([0.5, 0.5, 0.3, 0.5])),
        advantages=torch.tensor([1.0, -1.0, 1.0, 1.0]),
        token_sample=torch.tensor([0, 0, 1, 1]),
        topk_logprobs=torch.zeros(4, 2),
        sampler_topk_logprobs=torch.log(torch.tensor([[0.5, 0.2]] * 4)),
    )
    m = metric_floats(loss_metrics(inp, cfg, entropy=torch.tensor([1.0, 2.0, 3.0, 4.0])))
    # ratios 1.0, 0.4, 3.0, 0.2 -> 0.4 and 0.2 are below clip_min 0.5
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.2)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)
    assert m["sampling/masked_mean"] == pytest.approx(0.5)
    assert m["sampling/sampler_mass"] == pytest.approx(0.7)
    assert m["entropy"] == pytest.approx(2.5)
    assert m["clip_ratio/low_mean"] == pytest.approx(0.5)
    assert m["clip_ratio/high_mean"] == pytest.approx(0.25)
    assert m["clip_ratio/low_min"] == pytest.approx(0.5)  # each sample has one low token of 2
    assert m["clip_ratio/high_max"] == pytest.approx(0.5)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(5.0))  # ratio 0.2


def test_metrics_on_uneven_samples_tell_each_rule_apart():
    """Numbers chosen so that each rule gives a different value than its near miss: a ratio
    between 1 + epsilon and 1 + epsilon_high (not high-clipped), samples with different low
    fractions (min vs max), one token of four masked, rows of different sampler mass."""
    cfg = LossConfig(epsilon=0.2, epsilon_high=0.28)
    ratios = torch.tensor([0.7, 1.0, 1.25, 6.0])  # low | inside | inside (clip-higher) | high, masked
    inp = LossInputs(
        logprobs=ratios.log(), sampler_logprobs=torch.zeros(4),
        advantages=torch.tensor([1.0, 1.0, 1.0, 1.0]), token_sample=torch.tensor([0, 0, 1, 1]),
        topk_logprobs=torch.zeros(4, 2),
        sampler_topk_logprobs=torch.log(torch.tensor([[0.5, 0.2], [0.5, 0.2], [0.1, 0.1], [0.1, 0.1]])),
    )
    m = metric_floats(loss_metrics(inp, cfg, entropy=torch.ones(4)))
    assert m["clip_ratio/low_mean"] == pytest.approx(0.25)
    assert m["clip_ratio/high_mean"] == pytest.approx(0.25)  # 1.25 is not above 1.28
    assert m["clip_ratio/region_mean"] == pytest.approx(0.5)  # low or high
    assert m["clip_ratio/low_min"] == pytest.approx(0.0)  # sample 1 has no low token
    assert m["clip_ratio/high_max"] == pytest.approx(0.5)  # sample 1: one of two
    assert m["sampling/masked_mean"] == pytest.approx(0.25)  # 6.0 is past clip_max 5
    assert m["sampling/sampler_mass"] == pytest.approx((0.7 + 0.7 + 0.2 + 0.2) / 4)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(ratios.mean().item())


def test_build_loss_config_from_async_grpo_config():
    args = AsyncGRPOConfig(
        output_dir="/tmp/unused",
        temperature=0.7,
        epsilon=0.1,
        epsilon_high=0.3,
        score_centering=False,
        use_cpu=True,
    )
    cfg = build_loss_config(args)
    assert cfg == LossConfig(
        temperature=0.7,
        score_centering=False,
        clip_min=0.5,
        clip_max=5.0,
        epsilon=0.1,
        epsilon_high=0.3,
        router_aux_loss_coef=0.0,
    )


@pytest.mark.parametrize("score_centering", [True, False])
def test_row_loss_on_a_packed_row(tiny_qwen3, shared_samples, score_centering):
    """row_loss is the loss the config names (score centering or the clipped surrogate), on
    log-probs at the config's temperature, divided by the micro-batch's trained tokens (here
    twice this row's, as when another row shares the micro-batch)."""
    enable_tree_attention(tiny_qwen3)
    row = pack_row(shared_samples)
    cfg = LossConfig(score_centering=score_centering, temperature=0.7)
    loss, metrics = row_loss(tiny_qwen3, row, cfg, num_trained_tokens_global=2 * row.num_trained)
    loss.backward()
    metrics = metric_floats(metrics)
    with torch.no_grad():
        token = forward_row(tiny_qwen3, row, temperature=0.7).token
        other = forward_row(tiny_qwen3, row, temperature=1.0).token
    assert (token.logprobs - other.logprobs).abs().max() > 1e-3  # the temperature matters here
    inp = LossInputs(logprobs=token.logprobs, sampler_logprobs=row.sampler_logprobs,
                     advantages=row.advantages, topk_logprobs=token.topk_logprobs,
                     sampler_topk_logprobs=row.sampler_topk_logprobs)
    chosen = score_centering_loss if score_centering else clipped_surrogate_loss
    expected = chosen(inp, cfg) / (2 * row.num_trained)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-7)
    grads = [p.grad for p in tiny_qwen3.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert ("sampling/sampler_mass" in metrics) == score_centering
    assert 0 <= metrics["sampling/masked_mean"] <= 1 and metrics["entropy"] > 0


def test_the_clipped_surrogate_clips_above_at_epsilon_high():
    """Ratios between 1 + epsilon and 1 + epsilon_high are not clipped (DAPO's clip-higher),
    ratios past it are; below, 1 - epsilon applies. Ratios set by hand: the random ones of the
    formula test rarely land there."""
    cfg = LossConfig(score_centering=False, clip_min=0.1, clip_max=10.0, epsilon=0.2,
                     epsilon_high=0.28)
    ratios = torch.tensor([1.25, 1.4, 0.7, 0.7], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    inp = LossInputs(logprobs=ratios.log(), sampler_logprobs=torch.zeros(4, dtype=torch.float64),
                     advantages=adv)
    # min(r A, clip(r) A): 1.25 (inside), 1.28 (clipped high), -0.8 (clipped low), 0.7
    expected = -(1.25 + 1.28 - 0.8 + 0.7)
    assert clipped_surrogate_loss(inp, cfg).item() == pytest.approx(expected)


def test_empty_row_gives_a_zero_loss_that_still_runs_the_model(tiny_qwen3):
    enable_tree_attention(tiny_qwen3)
    loss, metrics = row_loss(tiny_qwen3, pack_row([]), LossConfig(), num_trained_tokens_global=5)
    loss.backward()
    assert loss.item() == 0.0 and metrics == {}
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in tiny_qwen3.parameters())


def test_gradient_accumulation_invariance(tiny_qwen3, sample_factory):
    """1 micro-batch of 8 samples == 8 micro-batches of 1 (equal trained tokens per sample)."""
    import random

    gen = random.Random(3)
    prompt = [gen.randrange(1, 90) for _ in range(7)]
    samples = [
        sample_factory(
            prompt + [gen.randrange(1, 90) for _ in range(5)],
            [0] * 7 + [1] * 5,
            advantage=gen.uniform(-1, 1),
            group_id=0,
            topk=3,
            seed=i,
        )
        for i in range(8)
    ]
    cfg = LossConfig()
    one = copy.deepcopy(tiny_qwen3)
    enable_tree_attention(one)
    row = pack_row(samples)
    loss, _ = row_loss(one, row, cfg, num_trained_tokens_global=row.num_trained)
    loss.backward()

    eight = copy.deepcopy(tiny_qwen3)
    enable_tree_attention(eight)
    for s in samples:
        r = pack_row([s])
        loss_i, _ = row_loss(eight, r, cfg, num_trained_tokens_global=r.num_trained)
        (loss_i / len(samples)).backward()
    for (name, a), (_, b) in zip(one.named_parameters(), eight.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_moe_aux_loss_is_added_with_its_coefficient():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    model = Qwen3MoeForCausalLM(cfg)
    enable_tree_attention(model)
    from grpo_agent.types import TrainingSample, TrainingSequence

    seq = TrainingSequence([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1], [-1.0] * 6)
    row = pack_row([TrainingSample(seq, advantage=1.0, model_version=0, group_id=0, row_index=0)])
    plain, m0 = row_loss(model, row, LossConfig(router_aux_loss_coef=0.0), 2 * row.num_trained)
    with_aux, m1 = row_loss(model, row, LossConfig(router_aux_loss_coef=0.1), 2 * row.num_trained)
    m1 = metric_floats(m1)
    assert "aux_loss" not in m0 and m1["aux_loss"] > 0
    # the row holds half the micro-batch's trained tokens -> half of coef * aux
    assert (with_aux - plain).item() == pytest.approx(0.1 * m1["aux_loss"] * 0.5, rel=1e-5)
    # and it trains: its gradient (the router's, above all) is added with the same weight
    grads = []
    for loss in (plain, with_aux):
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    forward_row(model, row, temperature=1.0, with_aux_loss=True).aux_loss.backward()
    aux_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert max(aux_grads[n].abs().max().item() for n in aux_grads if ".mlp.gate." in n) > 0
    for name, grad in aux_grads.items():
        torch.testing.assert_close(grads[1][name] - grads[0][name], 0.1 * 0.5 * grad,
                                   atol=1e-7, rtol=1e-4, msg=name)


def test_score_centering_ignores_padded_topk_entries():
    cfg = LossConfig()
    theta, log_mu, sampled, top_ids, adv = _toy(cfg)
    full = _inputs(theta, log_mu, sampled, top_ids, adv)
    padded = _inputs(theta, log_mu, sampled, top_ids, adv)
    # one more column that is padding: no sampler entry, an arbitrary (even -inf) trainer value
    pad_col = torch.full((P, 1), float("-inf"), dtype=torch.float64)
    padded.topk_logprobs = torch.cat([padded.topk_logprobs, pad_col], dim=1)
    padded.sampler_topk_logprobs = torch.cat([padded.sampler_topk_logprobs, pad_col], dim=1)
    a, b = score_centering_loss(full, cfg), score_centering_loss(padded, cfg)
    assert torch.isfinite(b)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("clip_min,clip_max", [(1.0, 2.0), (0.5, 1.0)])
def test_a_ratio_on_either_importance_sampling_bound_is_kept(clip_min, clip_max):
    """The spec keeps tokens with C_min <= r <= C_max: a ratio exactly on a bound trains and is
    not counted in sampling/masked_mean (ratio exactly 1: trainer and sampler log-probs equal)."""
    cfg = LossConfig(clip_min=clip_min, clip_max=clip_max)
    logp = torch.tensor([-0.5, -2.0], dtype=torch.float64, requires_grad=True)
    inp = LossInputs(logprobs=logp, sampler_logprobs=logp.detach().clone(),
                     advantages=torch.tensor([1.0, -2.0], dtype=torch.float64),
                     token_sample=torch.tensor([0, 0]))
    # f(r) = 1 on both tokens: -(1 * 1 * -0.5 + -2 * 1 * -2.0)
    assert score_centering_loss(inp, cfg).item() == pytest.approx(-(0.5 * -1 + 4.0))
    (grad,) = torch.autograd.grad(score_centering_loss(inp, cfg), logp)
    assert grad.tolist() == pytest.approx([-1.0, 2.0])
    clipped = LossConfig(score_centering=False, clip_min=clip_min, clip_max=clip_max)
    assert clipped_surrogate_loss(inp, clipped).item() == pytest.approx(-(1.0 - 2.0))
    assert metric_floats(loss_metrics(inp, cfg, torch.ones(2)))["sampling/masked_mean"] == 0.0


def test_a_ratio_on_the_trust_region_bound_is_not_clipped():
    """clip_ratio/low counts r < 1 - epsilon and clip_ratio/high r > 1 + epsilon_high, strictly:
    with both epsilons 0, a ratio of exactly 1 is in neither."""
    inp = LossInputs(logprobs=torch.tensor([-1.0, -3.0]), sampler_logprobs=torch.tensor([-1.0, -3.0]),
                     advantages=torch.tensor([1.0, -1.0]), token_sample=torch.tensor([0, 1]))
    for score_centering in (True, False):
        cfg = LossConfig(epsilon=0.0, epsilon_high=0.0, score_centering=score_centering)
        m = metric_floats(loss_metrics(inp, cfg, torch.ones(2)))
        assert m["clip_ratio/low_mean"] == m["clip_ratio/high_mean"] == 0.0
        assert m["clip_ratio/region_mean"] == m["clip_ratio/high_max"] == 0.0


def test_without_score_centering_clip_metrics_count_only_where_the_clip_binds():
    """The surrogate's min(r A, clip(r) A) only takes the clipped value for r < 1 - epsilon
    when A < 0 and for r > 1 + epsilon_high when A > 0 (as GRPO counts them), so a zero
    advantage is clipped on neither side; with score centering nothing is clipped and every
    token outside the trust region counts."""
    ratios = torch.tensor([0.5, 0.5, 2.0, 2.0, 0.5, 2.0, 0.5])
    inp = LossInputs(logprobs=ratios.log(), sampler_logprobs=torch.zeros(7),
                     advantages=torch.tensor([-1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 0.0]),
                     token_sample=torch.tensor([0, 0, 0, 0, 1, 1, 1]))
    surrogate = metric_floats(loss_metrics(inp, LossConfig(score_centering=False), torch.ones(7)))
    assert surrogate["clip_ratio/low_mean"] == pytest.approx(2 / 7)  # tokens 0 and 4
    assert surrogate["clip_ratio/high_mean"] == pytest.approx(1 / 7)  # token 2
    assert surrogate["clip_ratio/region_mean"] == pytest.approx(3 / 7)
    assert surrogate["clip_ratio/low_min"] == pytest.approx(0.25)  # sample 0: 1 of 4 (1: 1 of 3)
    assert surrogate["clip_ratio/high_max"] == pytest.approx(0.25)  # sample 1 has none
    centred = metric_floats(loss_metrics(inp, LossConfig(score_centering=True), torch.ones(7)))
    assert centred["clip_ratio/low_mean"] == pytest.approx(4 / 7)
    assert centred["clip_ratio/high_mean"] == pytest.approx(3 / 7)
    assert centred["clip_ratio/region_mean"] == pytest.approx(1.0)


def test_token_samples_are_numbered_densely_over_samples_with_trained_tokens(sample_factory):
    """A sample without trained tokens takes no number: the per-sample clip metrics index a
    [trained tokens] table, which three samples with one trained token between them overflow."""
    from grpo_agent.train.loss import dense_token_samples

    row = pack_row([sample_factory([1, 2, 3], [0, 0, 0], seed=1),
                    sample_factory([1, 4, 5], [0, 0, 0], seed=2),
                    sample_factory([1, 6, 7], [0, 0, 1], seed=3),
                    sample_factory([1, 6, 8, 9], [0, 0, 1, 1], seed=4)])
    assert row.token_sample.tolist() == [2, 3, 3]
    assert dense_token_samples(row).tolist() == [0, 1, 1]


def test_a_micro_batch_without_trained_tokens_is_refused(tiny_qwen3, shared_samples):
    enable_tree_attention(tiny_qwen3)
    with pytest.raises(ValueError, match="must be positive"):
        row_loss(tiny_qwen3, pack_row(shared_samples), LossConfig(), num_trained_tokens_global=0)


def test_a_none_aux_coefficient_takes_the_models_own():
    """router_aux_loss_coef=None uses the model config's value (0 where it has none)."""
    from types import SimpleNamespace

    args = AsyncGRPOConfig(output_dir="/tmp/unused", use_cpu=True)
    assert args.router_aux_loss_coef is None
    moe = SimpleNamespace(config=SimpleNamespace(router_aux_loss_coef=0.013))
    assert build_loss_config(args, moe).router_aux_loss_coef == pytest.approx(0.013)
    assert build_loss_config(args, SimpleNamespace(config=SimpleNamespace())).router_aux_loss_coef == 0.0
    args.router_aux_loss_coef = 0.0
    assert build_loss_config(args, moe).router_aux_loss_coef == 0.0


def test_the_empty_rows_zero_loss_reaches_every_parameter(tiny_qwen3):
    """Every parameter, the LM head included, gets a (zero) gradient from an empty row: under
    FSDP its gathers and gradient reduction run as on the ranks that have tokens."""
    enable_tree_attention(tiny_qwen3)
    loss, _ = row_loss(tiny_qwen3, pack_row([]), LossConfig(), num_trained_tokens_global=5)
    loss.backward()
    for name, p in tiny_qwen3.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() == 0, name
