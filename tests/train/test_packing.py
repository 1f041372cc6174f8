"""Tree packing: the spec's five-step example, and packed == unpacked log-probs/gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import dense_tree_mask, enable_tree_attention

P1, P2, P3, A1, A2, B1, B2 = 11, 12, 13, 21, 22, 31, 32


def test_spec_five_step_example(sample_factory):
    r0 = sample_factory([P1, P2, P3, A1, A2], [0, 0, 0, 1, 1])
    r1 = sample_factory([P1, P2, P3, B1, B2], [0, 0, 0, 1, 1])
    row = pack_row([r0, r1])
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.segment_ids.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert row.segment_paths == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 5, 6, 7]]
    assert row.pred_index.tolist() == [2, 3, 5, 6]
    assert row.targets.tolist() == [A1, A2, B1, B2]
    assert row.token_sample.tolist() == [0, 0, 1, 1]
    assert (row.unpacked_tokens, row.num_tokens) == (10, 8)
    mask = dense_tree_mask(row.segment_ids, row.segment_ancestors)
    visible = [torch.nonzero(mask[i]).flatten().tolist() for i in (1, 4, 7)]
    assert visible == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 5, 6, 7]]


def test_trained_position_is_never_shared_but_context_is(sample_factory):
    # Same first completion token in both rollouts: the position predicting it is trained by
    # both, so it is duplicated; the fork that only reads `a` as context shares it.
    a = sample_factory([1, 2, 3, 4], [0, 0, 1, 1])
    b = sample_factory([1, 2, 3, 5], [0, 0, 1, 1])
    fork = sample_factory([1, 2, 3, 4, 6], [0, 0, 0, 0, 1])
    row = pack_row([a, b, fork])
    assert row.input_ids.tolist() == [1, 2, 3, 4, 6, 2, 3, 5]
    assert row.pred_index.tolist() == [1, 2, 5, 6, 3]


def _unpacked_logprobs(model, samples, temperature):
    out = []
    for s in samples:
        ids = torch.tensor([s.sequence.token_ids])
        logits = model(input_ids=ids).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        for t, m in enumerate(s.sequence.trained_mask):
            if m and t > 0:
                out.append(logp[t - 1, s.sequence.token_ids[t]])
    return torch.stack(out)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature,backend", [(1.0, "gather"), (0.7, "gather"), (1.0, "sdpa")])
def test_packed_matches_unpacked(tiny_qwen3, shared_samples, temperature, backend):
    packed_model = copy.deepcopy(tiny_qwen3)
    enable_tree_attention(packed_model)
    row = pack_row(shared_samples)
    assert row.num_tokens < row.unpacked_tokens  # prompts and history are shared

    ref = _unpacked_logprobs(tiny_qwen3, shared_samples, temperature)
    got = forward_row(packed_model, row, temperature=temperature, backend=backend).token.logprobs
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    weights = torch.randn(ref.shape)
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    ref_g, got_g = _grads(tiny_qwen3), _grads(packed_model)
    assert ref_g.keys() == got_g.keys()
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], atol=1e-4, rtol=1e-4, msg=name)


def test_plain_model_call_in_tree_mode_is_a_clear_error(tiny_qwen3):
    enable_tree_attention(tiny_qwen3)
    with pytest.raises(ValueError, match="without a packed row"):
        tiny_qwen3(input_ids=torch.tensor([[1, 2, 3]]))


def test_models_with_attention_sinks_are_rejected():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    with pytest.raises(ValueError, match="attention sinks"):
        enable_tree_attention(GptOssForCausalLM(cfg))


def test_linear_attention_hybrids_are_rejected(tiny_qwen3):
    tiny_qwen3.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="linear_attention"):
        enable_tree_attention(tiny_qwen3)


def test_gradient_checkpointing_keeps_packed_gradients(tiny_qwen3, shared_samples):
    enable_tree_attention(tiny_qwen3)
    checkpointed = copy.deepcopy(tiny_qwen3)
    checkpointed.gradient_checkpointing_enable({"use_reentrant": False})
    checkpointed.train()
    row = pack_row(shared_samples)
    for model in (tiny_qwen3, checkpointed):
        forward_row(model, row, temperature=1.0).token.logprobs.sum().backward()
    for (name, a), (_, b) in zip(tiny_qwen3.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_topk_of_samples_with_different_widths_is_padded_to_the_widest(sample_factory):
    """Each trained token keeps its own sampler top-k, left-aligned and padded (-1 / -inf) to the
    row's widest; a sample without top-k gives padding rows, not a row without top-k."""
    import numpy as np
    from grpo_agent.types import TrainingSample, TrainingSequence

    def sample(ids, mask, top):
        lps = [-0.5 * (t + 1) if m else 0.0 for t, m in enumerate(mask)]
        seq = TrainingSequence(list(ids), list(mask), lps, sampler_top_logprobs=top)
        return TrainingSample(seq, advantage=1.0, model_version=0, group_id=0, row_index=0)

    wide = sample([1, 2, 3, 4], [0, 0, 1, 1], [None, None, {7: -0.25, 8: -1.5, 9: -2.0}, {5: -0.5}])
    plain = sample([1, 2, 6], [0, 0, 1], None)
    narrow = sample([1, 2, 9, 9], [0, 0, 1, 1], [None, None, {4: -0.75}, {3: -0.125, 2: -3.0}])
    row = pack_row([wide, plain, narrow])
    inf = -np.inf
    assert row.sampler_topk_ids.tolist() == [[7, 8, 9], [5, -1, -1], [-1, -1, -1], [4, -1, -1],
                                             [3, 2, -1]]
    assert row.sampler_topk_logprobs.tolist() == [[-0.25, -1.5, -2.0], [-0.5, inf, inf],
                                                  [inf, inf, inf], [-0.75, inf, inf],
                                                  [-0.125, -3.0, inf]]
    assert row.sampler_logprobs.tolist() == [-1.5, -2.0, -1.5, -1.5, -2.0]
