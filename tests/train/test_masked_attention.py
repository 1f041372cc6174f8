"""Masked tree attention: the block lists cover exactly the tree rule (forward per query block,
backward per key block; full blocks only where every pair is visible), the op equals dense
masked attention with GQA, the model path equals the dense tree mask, and compiled layers call
it as one op. FlashAttention 4 is a seam on CPU ("reference" applies the same block lists in
float32 math); the GPU tests at the end hold FA4 to it."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from grpo_agent.train import masked_attention
from grpo_agent.train.forward import forward_row
from grpo_agent.train.masked_attention import (
    BLOCK,
    MaskedPlan,
    block_pairs,
    listed_mask,
    masked_tree_attention,
)
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import dense_tree_mask, enable_tree_attention, visible_until

from .conftest import assert_tree_path_matches_sdpa, compiled_layer_ops, make_sample

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _forest_row(seed: int, groups: int = 3, vocab: int = 96):
    """Groups sharing prompts of 1-3 blocks and completions of 1-300 tokens, and a multi-turn
    group whose history forks twice; lengths land anywhere relative to the 128-token blocks."""
    gen = random.Random(seed)

    def tokens(n):
        return [gen.randrange(1, vocab) for _ in range(n)]

    samples = []
    for g in range(groups):
        prompt = tokens(gen.randint(20, 3 * BLOCK))
        for _ in range(gen.randint(1, 5)):
            comp = tokens(gen.randint(1, 300))
            samples.append(make_sample(prompt + comp, [0] * len(prompt) + [1] * len(comp),
                                       group_id=g))
    head, turn = tokens(gen.randint(10, 200)), tokens(gen.randint(5, 150))
    for history in (head + turn, head + turn, head):
        comp = tokens(gen.randint(3, 180))
        samples.append(make_sample(history + comp, [0] * len(history) + [1] * len(comp),
                                   group_id=groups))
    return pack_row(samples)


def _until(row):
    return visible_until(row.segment_ids, row.segment_ancestors)


@pytest.mark.parametrize("key_block", [BLOCK, 64])
@pytest.mark.parametrize("seed", range(6))
def test_block_lists_cover_exactly_the_tree_rule(seed, key_block):
    row = _forest_row(seed)
    n, rule = row.num_tokens, dense_tree_mask(row.segment_ids, row.segment_ancestors)
    plan = MaskedPlan.build(_until(row), "reference", key_block)
    assert plan.key_block == key_block  # what both FA4 calls are given
    assert torch.equal(listed_mask(plan.until, *plan.blocks[:4], n), rule)
    assert torch.equal(listed_mask(plan.until, *plan.blocks[4:], n, transposed=True), rule)
    _, visible, full = block_pairs(_until(row), key_block)
    blocks = -(-n // BLOCK)
    padded_rule = F.pad(rule, (0, blocks * BLOCK - n, 0, blocks * BLOCK - n))
    key_blocks = blocks * BLOCK // key_block
    per_block = padded_rule.view(blocks, BLOCK, key_blocks, key_block).transpose(1, 2)
    assert torch.equal(visible, per_block.any(-1).any(-1))  # no visible block left out
    assert torch.equal(full, per_block.all(-1).all(-1))  # full exactly where all pairs are seen
    assert full.any() and (visible & ~full).any()  # both kinds occur on these rows


def test_a_full_block_listed_where_one_pair_is_hidden_shows_in_the_mask():
    """The check above can fail: mark one partial block full and the listed mask sees more."""
    row = _forest_row(1)
    plan = MaskedPlan.build(_until(row), "reference")
    _, visible, full = block_pairs(_until(row))
    m, col = (visible & ~full).nonzero()[0].tolist()
    wrong = full.clone()
    wrong[m, col] = True
    counts, indices = masked_attention._lists(wrong)
    got = listed_mask(plan.until, *plan.blocks[:2], counts, indices, row.num_tokens)
    assert not torch.equal(got, dense_tree_mask(row.segment_ids, row.segment_ancestors))


@pytest.mark.parametrize("head_dim", [16, 160])  # 128-key blocks, 64-key blocks
def test_op_equals_dense_masked_attention_with_gqa(head_dim):
    row = _forest_row(2)
    n = row.num_tokens
    rule = dense_tree_mask(row.segment_ids, row.segment_ancestors)
    plan = MaskedPlan.build(_until(row), "reference", masked_attention.key_block(head_dim))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, head_dim, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, n, head_dim, dtype=torch.float64, generator=gen,
                        requires_grad=True) for _ in range(2))
    got = masked_tree_attention(q, k, v, plan, head_dim ** -0.5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=rule, scale=head_dim ** -0.5,
                                         enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)  # the reference runs in float32
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    for a, b, name in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)),
                          torch.autograd.grad((ref * weights).sum(), (q, k, v)),
                          ("dq", "dk", "dv")):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_model_path_matches_the_dense_tree_mask(tiny_qwen3, shared_samples):
    enable_tree_attention(tiny_qwen3)
    assert_tree_path_matches_sdpa(tiny_qwen3, pack_row(shared_samples), "masked")


def test_compiled_layers_call_masked_attention_as_one_op(tiny_qwen3, shared_samples):
    enable_tree_attention(tiny_qwen3)
    ops = compiled_layer_ops(tiny_qwen3, pack_row(shared_samples), "masked")
    assert "grpo_agent.masked_attention.default" in ops


def test_masked_attention_op_registration():
    row = _forest_row(3, groups=1)
    plan = MaskedPlan.build(_until(row), "reference")
    n = row.num_tokens
    q = torch.randn(n, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    args = (q, k, v, plan.until, list(plan.blocks), 0.3, "reference")
    checks = torch.library.opcheck(masked_attention._masked_attention, args)
    assert set(checks.values()) == {"SUCCESS"}, checks


def test_masked_backend_refuses_what_fa4_cannot_run():
    from grpo_agent.train.tree_attention import masked_kernel

    assert masked_kernel(torch.device("cpu"), torch.float32) == "reference"
    with pytest.raises(ValueError, match="flash-attn-4|CUDA|bf16"):
        masked_kernel(torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="choose one of"):
        MaskedPlan.build(torch.tensor([1, 2]), "triton")


def test_fa4_plan_refuses_head_dims_that_have_not_run_on_a_gpu():
    row = _forest_row(0, groups=1)
    plan = MaskedPlan.build(_until(row), "reference", key_block=64)
    plan.kernel = "fa4"
    q = torch.zeros(1, 2, row.num_tokens, 192)  # FA4 tiles its backward by 96 keys
    with pytest.raises(ValueError, match="heads up to 128 wide or 256 wide"):
        masked_tree_attention(q, q[:, :1], q[:, :1], plan, None)


@pytest.mark.parametrize("head_dim,runs,keys", [(64, True, 128), (128, True, 128),
                                               (192, False, 64), (256, True, 64),
                                               (512, False, 64)])
def test_which_head_widths_fa4_takes_and_their_key_blocks(head_dim, runs, keys):
    """The widths that ran against the reference on a GPU (up to 128 with 128-key blocks, 256
    with 64-key blocks; FA4 tiles 192-wide backwards by 96 keys, which fits neither)."""
    assert masked_attention.fa4_runs(head_dim) is runs
    assert masked_attention.key_block(head_dim) == keys


def test_a_plan_with_the_wrong_key_block_for_the_heads_is_refused():
    row = _forest_row(0, groups=1)
    plan = MaskedPlan.build(_until(row), "reference")  # 128-key blocks
    q = torch.zeros(1, 2, row.num_tokens, 256)
    with pytest.raises(ValueError, match="need 64: build it with"):
        masked_tree_attention(q, q[:, :1], q[:, :1], plan, None)



def test_the_head_width_auto_sees(tiny_qwen3):
    from grpo_agent.train.forward import attention_head_dim
    from transformers import GPT2Config

    assert attention_head_dim(tiny_qwen3.config) == 16  # Qwen3 names it
    assert attention_head_dim(GPT2Config(n_embd=96, n_head=4)) == 24  # derived


# GPU: FlashAttention 4 ---------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 4])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_masked_attention_matches_the_reference(dtype, head_dim, seed):
    """FA4 with the tree mask_mod and the block lists, forward and backward (16 query heads
    over 8 key/value heads), against the reference in float32 on the same plan."""
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")
    row = _forest_row(seed, groups=4)
    n = row.num_tokens
    plan = MaskedPlan.build(_until(row).cuda(), "fa4", masked_attention.key_block(head_dim))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, 16, n, head_dim, device="cuda", generator=gen)
    k, v = (torch.randn(1, 8, n, head_dim, device="cuda", generator=gen) for _ in range(2))
    grad = torch.randn(1, n, 16, head_dim, device="cuda", generator=gen)

    def run(kernel, cast):
        inputs = [t.to(cast).requires_grad_() for t in (q, k, v)]
        plan.kernel = kernel
        out = masked_tree_attention(*inputs, plan, head_dim ** -0.5)
        out.backward(grad.to(cast))
        return [out, *(t.grad for t in inputs)]

    got, ref = run("fa4", dtype), run("reference", torch.float32)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, ref):
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_masked_model_path_matches_unpacked_in_bf16(tiny_qwen3, shared_samples):
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")
    from .test_gpu import _unpacked

    reference = tiny_qwen3.cuda()
    ref = _unpacked(reference, shared_samples)
    packed = copy.deepcopy(reference).to(torch.bfloat16)
    enable_tree_attention(packed)
    row = pack_row(shared_samples)
    got = forward_row(packed, row, temperature=1.0, backend="masked").token.logprobs
    flex = forward_row(packed, row, temperature=1.0, backend="flex").token.logprobs
    err, flex_err = (got - ref).abs().max().item(), (flex - ref).abs().max().item()
    assert err < 0.1 and err < 2 * flex_err + 1e-2, (err, flex_err)
    got.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in packed.parameters() if p.grad is not None)

