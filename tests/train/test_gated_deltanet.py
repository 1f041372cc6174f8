"""Gated DeltaNet hybrids in tree-packed rows: packed == unpacked, forward and backward.

The tiny hybrids have Qwen3.5's layout (three linear-attention layers, then full attention)
and real head structure; rows cover groups sharing a prompt, multi-turn forks, 1-token
segments, segments shorter than the convolution kernel, chunk boundaries (> 64 tokens) and
tries deeper than 3 levels. A control shows the rows would disagree without the tree path.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from grpo_agent.train import gated_deltanet
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import enable_tree_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import VOCAB, make_sample

LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512, "tie_word_embeddings": False,
          "attn_implementation": "sdpa"}


def _hybrid(layer_types=("linear_attention",) * 3 + ("full_attention",)):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(1234)
    cfg = Qwen3_5TextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                            **COMMON, **LINEAR)
    return Qwen3_5ForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def tiny_hybrid():
    return _hybrid()


@pytest.fixture(scope="module")
def packed_hybrid(tiny_hybrid):
    model = copy.deepcopy(tiny_hybrid)
    enable_tree_attention(model)
    return model


def _tokens(gen, n):
    return [gen.randrange(1, VOCAB) for _ in range(n)]


def _row_cases():
    """name -> samples; each stresses one way a segment's history can be read wrongly."""
    gen = random.Random(11)
    cases = {}
    prompt = _tokens(gen, 70)  # crosses a 64-token chunk, so siblings start mid-chunk
    cases["group_sharing_a_prompt"] = [
        make_sample(prompt + _tokens(gen, n), [0] * 70 + [1] * n, seed=i)
        for i, n in enumerate([1, 3, 90])  # a 1-token completion and one crossing chunks
    ]
    stem = _tokens(gen, 5)
    # siblings after a 1-token segment; segments of 1-3 tokens (< kernel 4) read grandparents
    a, b = _tokens(gen, 1), _tokens(gen, 2)
    cases["short_segments"] = [
        make_sample(stem + a + b + _tokens(gen, 1), [0] * 5 + [1] * 4, seed=1),
        make_sample(stem + a + b + _tokens(gen, 3), [0] * 5 + [1] * 6, seed=2),
        make_sample(stem + a + _tokens(gen, 2), [0] * 5 + [1] * 3, seed=3),
        make_sample(stem + _tokens(gen, 1), [0] * 5 + [1], seed=4),
    ]
    history = _tokens(gen, 6)
    turn1, tool = _tokens(gen, 5), _tokens(gen, 3)
    cases["multi_turn_history"] = [
        make_sample(history + turn1 + tool + _tokens(gen, 4), [0] * 6 + [1] * 5 + [0] * 3 + [1] * 4),
        make_sample(history + turn1 + _tokens(gen, 2) + _tokens(gen, 3), [0] * 13 + [1] * 3),
        make_sample(history + turn1 + tool + _tokens(gen, 2), [0] * 14 + [1] * 2),
    ]
    deep, samples = _tokens(gen, 4), []
    for level in range(6):  # a chain of forks: every fork point adds a depth
        samples.append(make_sample(deep + _tokens(gen, 2), [0] * len(deep) + [1, 1], seed=level))
        deep = deep + _tokens(gen, 1 + level % 3)
    cases["deeper_than_three_levels"] = samples
    return cases


def _unpacked_logprobs(model, samples):
    out = []
    for s in samples:
        logits = model(input_ids=torch.tensor([s.sequence.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        out += [logp[t - 1, s.sequence.token_ids[t]]
                for t in range(1, s.num_tokens) if s.sequence.trained_mask[t]]
    return torch.stack(out)


def _assert_packed_matches(plain, packed, samples, check_grads=True):
    row = pack_row(samples)
    plain.zero_grad(set_to_none=True)
    packed.zero_grad(set_to_none=True)
    ref = _unpacked_logprobs(plain, samples)
    got = forward_row(packed, row, temperature=1.0).token.logprobs
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    if not check_grads:
        return row
    weights = torch.randn(ref.shape)
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    mine = dict(packed.named_parameters())
    for name, param in plain.named_parameters():
        torch.testing.assert_close(mine[name].grad, param.grad, atol=1e-4, rtol=1e-4, msg=name)
    return row


@pytest.mark.parametrize("case", sorted(_row_cases()))
def test_packed_matches_unpacked(tiny_hybrid, packed_hybrid, case):
    row = _assert_packed_matches(tiny_hybrid, packed_hybrid, _row_cases()[case])
    depth = int(row.segment_ancestors.sum(1).max())
    assert row.num_tokens < row.unpacked_tokens
    if case == "deeper_than_three_levels":
        assert depth > 3


def test_groups_and_forks_of_the_shared_fixture(tiny_hybrid, packed_hybrid, shared_samples):
    _assert_packed_matches(tiny_hybrid, packed_hybrid, shared_samples)


def test_without_the_tree_path_the_rows_would_disagree(tiny_hybrid, packed_hybrid, monkeypatch):
    """Control: the state and convolution running across segments changes the log-probs."""
    samples = _row_cases()["short_segments"]
    ref = _unpacked_logprobs(tiny_hybrid, samples)
    monkeypatch.setattr(gated_deltanet, "build_plan", lambda *a, **k: None)
    with torch.no_grad():
        got = forward_row(packed_hybrid, pack_row(samples), temperature=1.0).token.logprobs
    assert (got - ref).abs().max() > 1e-3


@pytest.mark.slow
def test_compiled_layers_keep_each_rows_tree(tiny_hybrid):
    """`torch_compile=True` on a hybrid: dynamo traces the Gated DeltaNet layers with the tree
    path inside, and rows of other shapes and trees through the same graphs still equal the
    unpacked model (a plan baked into the first row's graph would fail the later rows)."""
    from grpo_agent.train.regional_compile import compile_decoder_layers
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    compiled = copy.deepcopy(tiny_hybrid)
    enable_tree_attention(compiled)
    counter = CompileCounter()  # traces with dynamo, runs the captured graphs eagerly
    compile_decoder_layers(compiled, backend=counter)
    cases = _row_cases()
    try:
        for case in ("group_sharing_a_prompt", "multi_turn_history", "short_segments"):
            _assert_packed_matches(tiny_hybrid, compiled, cases[case])
    finally:
        torch._dynamo.reset()
    assert counter.frame_count > 0


def test_qwen3_next_layers_pack_too():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(5)
    cfg = Qwen3NextConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=32,
                          **COMMON, **LINEAR)
    plain = Qwen3NextForCausalLM(cfg).float().eval()
    packed = copy.deepcopy(plain)
    enable_tree_attention(packed)
    _assert_packed_matches(plain, packed, _row_cases()["short_segments"])


def test_plan_taps_follow_each_tokens_own_path():
    """The first K-1 tokens of each segment (the rows the plain convolution gets wrong) read
    their own path; every other token's predecessors are the K-1 tokens before it in the row."""
    samples = _row_cases()["short_segments"]
    row = pack_row(samples)
    plan = gated_deltanet.DeltaPlan.build(row, "cpu", conv_kernel=4)
    ids = row.input_ids.tolist()
    fixed = plan.taps
    for s, path in enumerate(row.segment_paths):
        own = sum(int(row.segment_ids[i]) == s for i in path)
        for p, token in enumerate(path):
            if int(row.segment_ids[token]) != s:
                continue
            want = [None] * max(0, 3 - p) + [ids[i] for i in path[max(0, p - 3): p + 1]]
            if p - (len(path) - own) < 3:
                assert [None if i is None else ids[i] for i in fixed[token]] == want
            else:
                assert token not in fixed and ids[token - 3: token + 1] == want


def test_chunk_size_does_not_change_the_rule(tiny_hybrid, packed_hybrid, monkeypatch):
    """Chunks of 16 (many steps, siblings mid-chunk) give what the default chunks give (64 on
    CPU, 128 on CUDA)."""
    from grpo_agent.train import delta_rule

    samples = _row_cases()["group_sharing_a_prompt"] + _row_cases()["deeper_than_three_levels"]
    monkeypatch.setattr(delta_rule, "chunk_size", lambda device: 16)
    row = _assert_packed_matches(tiny_hybrid, packed_hybrid, samples)
    plan = gated_deltanet.DeltaPlan.build(row, "cpu", conv_kernel=4)
    assert plan.chunk == 16 and len(plan.step_sizes) > 5


def test_other_recurrent_layers_are_refused_by_name():
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
                      mamba_d_head=32, mamba_d_state=16, attn_layer_indices=[1])
    model = BambaForCausalLM(cfg)
    with pytest.raises(NotImplementedError, match="BambaMixer"):
        enable_tree_attention(model)


tries = st.lists(
    st.tuples(st.sampled_from([[1, 2], [1, 2, 3, 4, 5], [2]]),
              st.lists(st.integers(1, 3), min_size=1, max_size=7), st.integers(0, 3)),
    min_size=1, max_size=5,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tries)
def test_random_tries_match_unpacked(packed_small, specs):
    """Any trie (small alphabet: prefixes collide, segments are often 1-3 tokens)."""
    plain, packed = packed_small
    samples = []
    for stem, tail, prompt_len in specs:
        ids = stem + tail
        cut = min(prompt_len, len(ids) - 1)
        samples.append(make_sample(ids, [0] * cut + [1] * (len(ids) - cut)))
    if all(sum(s.sequence.trained_mask[1:]) == 0 for s in samples):
        return
    _assert_packed_matches(plain, packed, samples, check_grads=len(samples) % 2 == 0)


@pytest.fixture(scope="module")
def packed_small():
    plain = _hybrid(("linear_attention", "full_attention"))
    packed = copy.deepcopy(plain)
    enable_tree_attention(packed)
    return plain, packed


@pytest.mark.gpu
def test_fla_kernel_matches_torch_on_gpu():
    """On CUDA with flash-linear-attention: its varlen kernel == the torch path (float32)."""
    from grpo_agent.train import delta_rule

    if not torch.cuda.is_available() or delta_rule.fla_chunk_rule() is None:
        pytest.skip("needs CUDA and flash-linear-attention")
    plain = _hybrid().cuda()
    packed = copy.deepcopy(plain)
    enable_tree_attention(packed)
    samples = _row_cases()["deeper_than_three_levels"] + _row_cases()["group_sharing_a_prompt"]
    row = pack_row(samples)
    got = forward_row(packed, row, temperature=1.0).token.logprobs
    ref = _unpacked_logprobs(plain, samples)
    torch.testing.assert_close(got, ref.to(got.device), atol=2e-3, rtol=0)
