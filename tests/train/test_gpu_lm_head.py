"""CUDA: the fused Triton LM head (`fused_lm_head`) equals the float32 full-logits reference:
its log-sum-exp, entropy and gradients to float32 accuracy (the logits stay in float32
registers), the log-probs within bf16 tolerance (the target's logit is a bf16 dot product, as
on the torch path); at sizes that are not multiples of its blocks, over several backward
chunks, with a temperature, with tiles by pointer or by TMA. `auto` picks it on CUDA; a sampling
mask keeps the torch tiles."""

from __future__ import annotations

import pytest
import torch
from grpo_agent.train import fused_lm_head, logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _inputs(tokens, vocab, hidden):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    h = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.1).bfloat16()
    return h, w.requires_grad_(), gen


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    "tokens,vocab,hidden,tile", [(1000, 5000, 96, 1024), (300, 151936, 1024, None)]
)
def test_triton_head_matches_full_logits(monkeypatch, temperature, tokens, vocab, hidden, tile,
                                         tma):
    monkeypatch.setattr(logprobs, "LM_HEAD", "triton")
    monkeypatch.setitem(fused_lm_head.CONFIG, "TMA", tma)
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, gen = _inputs(tokens, vocab, hidden)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert fused_lm_head._operands(h, w, fused_lm_head.CONFIG)[1]["TMA"] == (tma and hopper)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    topk = torch.randint(-1, vocab, (tokens, 3), device="cuda", generator=gen)
    upstream = torch.randn(tokens, device="cuda", generator=gen)
    lse, entropy = logprobs.tiled_log_sum_exp(h, w, temperature, tile=tile)
    got = logprobs.token_logprobs(h, w, targets, temperature=temperature, topk_ids=topk,
                                  tile=tile)
    ((got.logprobs * upstream).sum() + got.topk_logprobs.sum() + lse.sum()).backward()
    hf, wf = (t.detach().float().requires_grad_() for t in (h, w))
    z = hf @ wf.T / temperature
    logp = torch.log_softmax(z, -1)
    ref_lp = logp.gather(1, targets[:, None]).squeeze(1)
    ref_topk = logp.gather(1, topk.clamp(min=0)).masked_fill(topk < 0, 0.0)
    ref_lse = torch.logsumexp(z, -1)
    ((ref_lp * upstream).sum() + ref_topk.sum() + ref_lse.sum()).backward()
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got.logprobs, ref_lp, atol=5e-2, rtol=0)
    torch.testing.assert_close(got.topk_logprobs, ref_topk, atol=5e-2, rtol=0)
    assert _rel(h.grad, hf.grad) < 1e-2 and _rel(w.grad, wf.grad) < 1e-2


def test_auto_runs_the_kernels_on_cuda_and_the_tiles_under_a_sampling_mask(monkeypatch):
    calls = []
    real = fused_lm_head.triton_partials
    monkeypatch.setattr(fused_lm_head, "triton_partials",
                        lambda *a: calls.append(1) or real(*a))
    h, w, gen = _inputs(64, 1000, 128)
    targets = torch.randint(0, 1000, (64,), device="cuda", generator=gen)
    fused = logprobs.token_logprobs(h, w, targets)
    assert calls == [1]
    monkeypatch.setattr(logprobs, "LM_HEAD", "torch")
    tiles = logprobs.token_logprobs(h, w, targets)
    torch.testing.assert_close(fused.logprobs, tiles.logprobs, atol=5e-2, rtol=0)
    monkeypatch.setattr(logprobs, "LM_HEAD", "auto")
    candidates = torch.randint(0, 1000, (64, 5), device="cuda", generator=gen)
    logprobs.token_logprobs(h, w, targets, candidates=candidates)
    assert calls == [1]
