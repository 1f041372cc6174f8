"""Level attention: the depth split covers exactly the tree rule, the log-sum-exp merge and the
backward from the merged output are exact, and the model path equals the dense tree mask.

Flash kernels are a seam here (CPU CI has none): the "reference" kernel runs the same contract
in dense tensor math; `tests/train/test_gpu.py` holds PyTorch's flash build to it on CUDA."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from grpo_agent.train.level_attention import LevelPlan, level_tree_attention
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import dense_tree_mask, enable_tree_attention

from .conftest import VOCAB, assert_tree_path_matches_sdpa, compiled_layer_ops, make_sample


def _deep_tree_samples():
    """Two groups sharing prompts, and untrained history that forks twice (three levels)."""
    gen = random.Random(11)

    def tokens(n):
        return [gen.randrange(1, VOCAB) for _ in range(n)]

    samples = []
    for group in range(2):
        prompt = tokens(9)
        for i in range(3):
            comp = tokens(4 + i)
            samples.append(make_sample(prompt + comp, [0] * 9 + [1] * len(comp), group_id=group))
    head, turn = tokens(5), tokens(6)
    for history in (head + turn, head + turn, head + turn, head):
        comp = tokens(gen.randint(3, 6))
        samples.append(make_sample(history + comp, [0] * len(history) + [1] * len(comp),
                                   group_id=5))
    return samples


def _plan_visibility(plan: LevelPlan, n: int) -> torch.Tensor:
    """[N, N] bool: what the plan's parts let each query see."""
    seen = torch.zeros(n, n, dtype=torch.bool)
    cu = plan.self_cu.tolist()
    for a, b in itertools.pairwise(cu):
        seen[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    for qi, ki, cu_q, cu_k in zip(plan.query_index, plan.key_index, plan.cu_q, plan.cu_k):
        bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
        for q0, q1, k0, k1 in bounds:
            rows, cols = qi[q0:q1], ki[k0:k1]
            assert not seen[rows[:, None], cols[None, :]].any(), "a pair is covered twice"
            seen[rows[:, None], cols[None, :]] = True
    return seen


def test_plan_covers_the_tree_rule_once_per_pair():
    row = pack_row(_deep_tree_samples())
    plan = LevelPlan.build(row, "cpu", "reference")
    assert len(plan.query_index) == 2  # prompts and the history's first fork, then the second
    for qi, ki in zip(plan.query_index, plan.key_index):
        assert qi.unique().numel() == qi.numel() and ki.unique().numel() == ki.numel()
    expected = dense_tree_mask(row.segment_ids, row.segment_ancestors)
    assert torch.equal(_plan_visibility(plan, row.num_tokens), expected)


def test_rows_without_sharing_have_only_the_self_part():
    samples = [make_sample([i + 1, 5, 6, 7], [0, 1, 1, 1], group_id=i) for i in range(3)]
    plan = LevelPlan.build(pack_row(samples), "cpu", "reference")
    assert plan.query_index == [] and plan.self_cu.tolist() == [0, 4, 8, 12]


def test_unknown_kernel_is_rejected():
    with pytest.raises(ValueError, match="choose one of"):
        LevelPlan.build(pack_row(_deep_tree_samples()), "cpu", "triton")


def test_merge_and_backward_are_exact_with_gqa():
    """float64: out and dq/dk/dv equal attention with the dense tree mask."""
    row = pack_row(_deep_tree_samples())
    plan = LevelPlan.build(row, "cpu", "reference")
    assert_exact_against_dense_mask(row, plan)


def assert_exact_against_dense_mask(row, plan):
    """float64, GQA (4 query heads over 2 K/V heads): `plan`'s output and dq/dk/dv equal
    attention with the row's dense tree mask."""
    n = row.num_tokens
    q = torch.randn(1, 4, n, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = dense_tree_mask(row.segment_ids, row.segment_ancestors)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    ref = ref.transpose(1, 2)
    got = level_tree_attention(q, k, v, plan, 0.3)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    weights = torch.randn_like(ref)
    for a, b, name in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)),
                          torch.autograd.grad((ref * weights).sum(), (q, k, v)),
                          ("dq", "dk", "dv")):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("deep", [False, True])
def test_model_path_matches_the_dense_tree_mask(tiny_qwen3, shared_samples, deep):
    enable_tree_attention(tiny_qwen3)
    row = pack_row(_deep_tree_samples() if deep else shared_samples)
    assert_tree_path_matches_sdpa(tiny_qwen3, row, "levels")


def test_levels_on_cuda_needs_half_precision_flash():
    """On CUDA the dense reference would be quadratic in the row: float32 is refused clearly."""
    from grpo_agent.train.tree_attention import _level_kernel

    assert _level_kernel(torch.device("cpu"), torch.float32) == "reference"
    with pytest.raises(ValueError, match="bf16/fp16"):
        _level_kernel(torch.device("cuda"), torch.float32)


def test_compiled_layers_call_the_level_split_as_one_op(tiny_qwen3, shared_samples,
                                                       monkeypatch):
    """In compiled decoder layers the level split is one custom op (and one backward op):
    dynamo's graph holds the op and never traces the parts (traced as an autograd.Function,
    the flash path's gradients were wrong on an H200), and the gradients are the eager
    model's."""
    from grpo_agent.train import level_attention

    traced = []
    for name in ("_part_forward", "_part_backward"):
        real = getattr(level_attention, name)

        def recording(*args, real=real, name=name):
            traced.append((name, torch.compiler.is_compiling()))
            return real(*args)

        monkeypatch.setattr(level_attention, name, recording)

    enable_tree_attention(tiny_qwen3)
    ops = compiled_layer_ops(tiny_qwen3, pack_row(shared_samples), "levels")
    layers = tiny_qwen3.config.num_hidden_layers
    calls = 2 * 2 * layers  # two parts per layer, two models
    assert sorted(traced) == [("_part_backward", False)] * calls + [("_part_forward", False)] * calls
    assert "grpo_agent.level_attention.default" in ops


@pytest.mark.parametrize("merge", ["rows", "float32"])
def test_level_attention_op_registration(shared_samples, merge):
    """torch.library's own checks of the op: schema, autograd registration, the fake
    function against the real outputs, and AOT autograd (dynamic shapes) against eager."""
    from grpo_agent.train import level_attention

    plan = LevelPlan.build(pack_row(shared_samples), "cpu", "reference", dense="off")
    plan.merge = merge
    layout, tensors = plan.parts()
    n = plan.self_cu[-1].item()
    q = torch.randn(n, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    args = (q, k, v, list(tensors), level_attention._encode(layout), 0.3, "reference", "",
            merge)
    checks = torch.library.opcheck(level_attention._level_attention, args)
    assert set(checks.values()) == {"SUCCESS"}, checks

