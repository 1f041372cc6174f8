"""The fused LM head on CPU: per-vocabulary-block softmax statistics merged by `combine_blocks`,
and the per-chunk softmax gradient, equal the full-logits reference; `FusedLogSumExp` itself
(its chunk loop, temperature and gradient matmuls) with the two kernels replaced by those torch
references; and the choice between the Triton kernels and the torch tiles (the kernels
themselves run in test_gpu_lm_head.py)."""

from __future__ import annotations

import pytest
import torch
from grpo_agent.train import fused_lm_head, logprobs


def _inputs(tokens=37, vocab=300, hidden=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen, dtype=torch.float64),
            torch.randn(vocab, hidden, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block", [7, 64, 300, 512])
def test_block_statistics_merge_to_the_log_sum_exp_and_entropy(temperature, block):
    hidden, weight = _inputs()
    lse, entropy = fused_lm_head.combine_blocks(
        *fused_lm_head.block_partials(hidden, weight, temperature, block_v=block))
    z = hidden @ weight.T / temperature
    logp = torch.log_softmax(z, -1)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=1e-10, rtol=0)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), atol=1e-10, rtol=0)


def test_blocks_without_ids_add_nothing():
    hidden, weight = _inputs(vocab=40)
    parts = fused_lm_head.block_partials(hidden, weight, 1.0, block_v=16)
    empty = (torch.full((1, 37), float("-inf"), dtype=torch.float64),
             torch.zeros(1, 37, dtype=torch.float64), torch.zeros(1, 37, dtype=torch.float64))
    padded = [torch.cat([p, e]) for p, e in zip(parts, empty)]
    for a, b in zip(fused_lm_head.combine_blocks(*padded), fused_lm_head.combine_blocks(*parts)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunk_softmax_gradients_give_the_log_sum_exp_gradient(temperature):
    hidden, weight = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    upstream = torch.randn(hidden.shape[0], dtype=torch.float64)
    (torch.logsumexp(h @ w.T / temperature, -1) * upstream).sum().backward()
    lse = torch.logsumexp(hidden @ weight.T / temperature, -1)
    scale = upstream / temperature
    grad_h, grad_w = torch.zeros_like(hidden), torch.empty_like(weight)
    for start in range(0, weight.shape[0], 128):  # the backward's vocabulary chunks
        chunk = weight[start:start + 128]
        g = fused_lm_head.chunk_softmax_grad(hidden, chunk, temperature, lse, scale)
        grad_h += g @ chunk
        grad_w[start:start + 128] = g.T @ hidden
    torch.testing.assert_close(grad_h, h.grad, atol=1e-10, rtol=0)
    torch.testing.assert_close(grad_w, w.grad, atol=1e-10, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_function_gives_the_full_logits_values_and_gradients(monkeypatch, temperature):
    """Everything of `FusedLogSumExp` but the two Triton kernels, whose torch references stand
    in: three vocabulary chunks, the last one short."""
    def partials(hidden, weight, temperature):
        return fused_lm_head.block_partials(hidden, weight, temperature, block_v=64)

    def softmax_grad(hidden, weight_chunk, temperature, lse, scale, out):
        return out.copy_(fused_lm_head.chunk_softmax_grad(hidden, weight_chunk, temperature,
                                                          lse, scale))

    monkeypatch.setattr(fused_lm_head, "triton_partials", partials)
    monkeypatch.setattr(fused_lm_head, "triton_softmax_grad", softmax_grad)
    # restored after the test: the backward turns it off where addmm lacks out_dtype (CPU)
    monkeypatch.setattr(fused_lm_head, "FLOAT32_ADDMM", fused_lm_head.FLOAT32_ADDMM)
    hidden, weight = (t.float() for t in _inputs())
    upstream = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(1))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lse, entropy = fused_lm_head.FusedLogSumExp.apply(h, w, temperature, 128)
    (lse * upstream).sum().backward()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T / temperature, -1)
    ref_lse = torch.logsumexp(h64 @ w64.T / temperature, -1)
    (ref_lse * upstream.double()).sum().backward()
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), -(logp.exp() * logp).sum(-1).detach(),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


def test_cpu_runs_the_torch_tiles_and_a_forced_triton_head_says_why_not(monkeypatch):
    hidden, weight = (t.float() for t in _inputs())
    assert not logprobs.use_fused_kernels(hidden, weight)
    monkeypatch.setattr(logprobs, "LM_HEAD", "triton")
    with pytest.raises(ValueError, match="CUDA half-precision"):
        logprobs.token_logprobs(hidden, weight, torch.zeros(37, dtype=torch.long))
    monkeypatch.setattr(logprobs, "LM_HEAD", "fast")
    with pytest.raises(ValueError, match="choose one of"):
        logprobs.use_fused_kernels(hidden, weight)


def test_a_triton_without_tensor_descriptors_keeps_the_pointer_loads(monkeypatch):
    """TMA asked for, but this Triton has no descriptors (torch 2.6's): the kernels get the
    tensors themselves and a config with TMA off, so they compile the pointer path."""
    monkeypatch.setattr(fused_lm_head, "_tensor_descriptor", lambda: None)
    hidden, weight = torch.zeros(4, 16), torch.zeros(8, 16)
    (h, w), config = fused_lm_head._operands(hidden, weight, {**fused_lm_head.CONFIG,
                                                              "TMA": True})
    assert h is hidden and w is weight and config["TMA"] is False
    assert fused_lm_head.CONFIG["TMA"] is True  # the shared default is left as it was
