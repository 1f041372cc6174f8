"""Tiled log-probs equal the full-logits path in value and gradient, with and without a
temperature, a sampling mask (renormalisation) and tiles smaller than the vocabulary."""

from __future__ import annotations

import pytest
import torch
from grpo_agent.train import logprobs
from grpo_agent.train.compiled_or_eager import CompiledOrEager
from grpo_agent.train.logprobs import naive_token_logprobs, token_logprobs

T, H, V = 13, 24, 203  # V not a multiple of the tile


def _inputs():
    hidden = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    return hidden, weight, targets


@pytest.mark.parametrize("temperature,tile", [(1.0, 64), (0.6, 7), (1.3, 4096)])
def test_tiled_matches_full_logits(temperature, tile):
    hidden, weight, targets = _inputs()
    got = token_logprobs(hidden, weight, targets, temperature=temperature, tile=tile)
    ref = naive_token_logprobs(hidden, weight, targets, temperature)
    torch.testing.assert_close(got.logprobs, ref.float(), atol=1e-5, rtol=0)

    logits = (hidden @ weight.T) / temperature
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(got.entropy.double(), -(p * torch.log(p)).sum(-1), atol=1e-4, rtol=0)

    w = torch.randn(T, dtype=torch.float64)
    g_got = torch.autograd.grad((got.logprobs.double() * w).sum(), (hidden, weight))
    logp_ref = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    g_ref = torch.autograd.grad((logp_ref * w).sum(), (hidden, weight))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_topk_and_sampling_mask_renormalise():
    hidden, weight, targets = _inputs()
    candidates = torch.full((T, 40), -1, dtype=torch.long)
    allowed = torch.zeros(T, V, dtype=torch.bool)
    for t in range(T):
        ids = torch.randperm(V)[:30]
        ids[0] = targets[t]
        candidates[t, :30] = ids
        allowed[t, ids] = True
    topk_ids = torch.stack([candidates[t, :4] for t in range(T)])
    topk_ids[0, 3] = -1  # padding
    got = token_logprobs(
        hidden, weight, targets, temperature=0.8, topk_ids=topk_ids, candidates=candidates, tile=50
    )

    logits = ((hidden @ weight.T) / 0.8).masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        got.logprobs.double(), logp.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0
    )
    ref_topk = logp.gather(1, topk_ids.clamp(min=0)).masked_fill(topk_ids < 0, 0.0)
    torch.testing.assert_close(got.topk_logprobs.double(), ref_topk, atol=1e-5, rtol=0)
    p = torch.softmax(logits, -1)
    ref_entropy = -(p * logp.masked_fill(~allowed, 0.0)).sum(-1)
    torch.testing.assert_close(got.entropy.double(), ref_entropy, atol=1e-4, rtol=0)

    w = torch.randn(T, 4, dtype=torch.float64)
    g_got = torch.autograd.grad(
        (got.topk_logprobs.double() * w).sum() + got.logprobs.sum(), (hidden, weight)
    )
    ref_loss = (ref_topk * w).sum() + logp.gather(1, targets[:, None]).sum()
    g_ref = torch.autograd.grad(ref_loss, (hidden, weight))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _tile_inputs():
    raw = torch.randn(5, 40)
    allowed = torch.rand(5, 40) > 0.3
    return raw, 0.7, allowed


def test_compiled_tile_function_is_used_where_asked(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        def run(*args):
            calls.append(kwargs)
            return fn(*args)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    on_cpu = CompiledOrEager(logprobs._tile_stats, devices=("cpu",))
    on_cuda_only = CompiledOrEager(logprobs._tile_stats)
    on_cpu(*_tile_inputs()), on_cuda_only(*_tile_inputs())
    assert calls == [{"dynamic": True}]


def test_failed_compilation_falls_back_to_eager(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no triton")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    wrapped = CompiledOrEager(logprobs._tile_stats, devices=("cpu",))
    raw, temperature, allowed = _tile_inputs()
    got = wrapped(raw, temperature, allowed)
    assert wrapped.failed and "no triton" in caplog.text
    z = (raw / temperature).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(got[0], z.amax(1))
    torch.testing.assert_close(got[1], torch.exp(z - z.amax(1, keepdim=True)).sum(1))


@pytest.mark.parametrize("device_type,budget", [("cuda", logprobs.DEFAULT_TILE_ELEMENTS),
                                                ("cpu", logprobs.CPU_TILE_ELEMENTS)])
@pytest.mark.parametrize("tokens", [1, 1750, 4079, 11000, 10**6])
def test_default_tile_width_is_aligned(tokens, device_type, budget):
    width = logprobs.default_tile_width(tokens, device_type)
    assert width % logprobs.TILE_ALIGN == 0 and width >= logprobs.TILE_ALIGN
    assert width * tokens <= max(budget, logprobs.TILE_ALIGN * tokens)


def test_cpu_tensors_get_the_cache_sized_tile(monkeypatch):
    """On CPU the default tile holds at most CPU_TILE_ELEMENTS logits (not the GPU's 2**26)."""
    seen = []
    original = logprobs._TiledLogSumExp.apply
    monkeypatch.setattr(logprobs._TiledLogSumExp, "apply",
                        lambda *args: seen.append(args[3]) or original(*args))
    hidden, weight = torch.randn(1750, 8), torch.randn(4096, 8)
    logprobs.tiled_log_sum_exp(hidden, weight)
    assert seen == [logprobs.default_tile_width(1750, "cpu")]
    assert seen[0] * 1750 <= logprobs.CPU_TILE_ELEMENTS


def test_a_failed_compile_logs_text_and_runs_eagerly(monkeypatch, caplog):
    """The warning's record holds the error's text, not the exception: its traceback's frames
    (inside a training step's forward) would keep that step's tensors alive with the record."""
    def broken_compile(fn, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken_compile)
    call = CompiledOrEager(lambda x: x * 2, devices=("cpu",))
    assert torch.equal(call(torch.ones(2)), torch.full((2,), 2.0))
    assert call.failed and "no compiler here" in caplog.text
    assert not [a for r in caplog.records for a in r.args if isinstance(a, BaseException)]
