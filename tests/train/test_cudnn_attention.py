"""Padded dense level parts (`cudnn_attention`): the padding, grouping and merge are exact.

cuDNN is a seam here (CPU CI has none): the "reference" dense kernel runs the same
[B, L, heads, dim] contract in dense tensor math; `tests/train/test_gpu.py` holds cuDNN to it."""

from __future__ import annotations

import random

import pytest
import torch
from grpo_agent.train import cudnn_attention
from grpo_agent.train.level_attention import LevelPlan, level_tree_attention
from grpo_agent.train.packing import pack_row

from .conftest import VOCAB, make_sample
from .test_level_attention import _deep_tree_samples, assert_exact_against_dense_mask


def _groups(prompt_len: int, completion_lens: list[list[int]]):
    gen = random.Random(3)
    samples = []
    for group, lens in enumerate(completion_lens):
        prompt = [gen.randrange(1, VOCAB) for _ in range(prompt_len)]
        for n in lens:
            comp = [gen.randrange(1, VOCAB) for _ in range(n)]
            samples.append(make_sample(prompt + comp, [0] * prompt_len + [1] * n, group_id=group))
    return samples


def test_self_parts_group_segments_by_length():
    segs = [range(10), range(10, 14), range(14, 20), range(20, 22), range(22, 31)]
    parts = cudnn_attention.self_parts(segs, "cpu")
    assert [(p.batch, p.len_q) for p in parts] == [(3, 10), (2, 4)]  # 6 >= 10 / 2, 2 >= 4 / 2
    covered = torch.cat([p.rows_q for p in parts]).sort().values
    assert torch.equal(covered, torch.arange(31))
    first = parts[0]
    assert torch.equal(first.q_index[2, :6], torch.arange(14, 20))
    assert not first.q_valid[2, 6:].any()


def test_depth_part_needs_one_key_length():
    same = [(range(4, 10), range(4)), (range(14, 17), range(10, 14))]
    part = cudnn_attention.depth_part(same, "cpu")
    assert (part.batch, part.len_q, part.len_k, part.causal) == (2, 6, 4, False)
    assert cudnn_attention.depth_part([(range(4, 10), range(4)),
                                       (range(13, 17), range(10, 13))], "cpu") is None


@pytest.mark.parametrize("samples", [
    _deep_tree_samples,
    lambda: _groups(7, [[3, 5, 4], [6, 2]]),
    lambda: _groups(5, [[9, 1, 4]]),
])
def test_dense_parts_are_exact_with_gqa(samples):
    """float64: out and dq/dk/dv with padded parts equal attention with the dense tree mask."""
    row = pack_row(samples())
    plan = LevelPlan.build(row, "cpu", "reference", dense="reference")
    assert plan.self_dense and len(plan.self_dense) >= 2
    assert_exact_against_dense_mask(row, plan)


def test_a_group_row_takes_the_prompt_part_dense():
    plan = LevelPlan.build(pack_row(_groups(7, [[3, 5, 4], [6, 2, 3]])), "cpu", "reference",
                           dense="reference")
    assert plan.depth_dense[0] is not None and plan.depth_dense[0].batch == 2
    layout, _ = plan.parts()
    assert [kind for kind, _ in layout] == ["dense"] * (len(plan.self_dense) + 1)


def test_auto_keeps_cpu_plans_on_varlen_and_rejects_unknown_names():
    row = pack_row(_deep_tree_samples())
    assert LevelPlan.build(row, "cpu", "reference").dense_kernel is None
    with pytest.raises(ValueError, match="choose one of"):
        LevelPlan.build(row, "cpu", "reference", dense="cudnn9")


def test_depth_only_keeps_the_self_part_on_the_varlen_kernel():
    row = pack_row(_groups(7, [[3, 5, 4], [6, 2, 3]]))
    plan = LevelPlan.build(row, "cpu", "reference", dense="cudnn-depth")
    layout, _ = plan.parts()
    assert [kind for kind, _ in layout] == ["self", "dense"]
    n = row.num_tokens
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(3))
    exact = LevelPlan.build(row, "cpu", "reference", dense="off")
    plan.dense_kernel = "reference"
    torch.testing.assert_close(level_tree_attention(q, k, v, plan, 0.3),
                               level_tree_attention(q, k, v, exact, 0.3), atol=1e-12, rtol=0)


def test_cudnn_parts_fall_back_to_varlen_for_unseen_head_sizes(monkeypatch):
    """A head size cuDNN was not checked with runs every part on the varlen kernel."""
    from grpo_agent.train import level_attention

    row = pack_row(_groups(7, [[3, 5, 4], [6, 2, 3]]))
    plan = LevelPlan.build(row, "cpu", "reference", dense="cudnn-depth")
    seen = []
    monkeypatch.setitem(level_attention._DENSE_FORWARD, "cudnn",
                        lambda *a: seen.append(a) or level_attention._dense_reference_forward(*a))
    n = row.num_tokens
    for dim, calls in ((8, 0), (64, 1)):
        q, k, v = (torch.randn(1, 2, n, dim, dtype=torch.float64) for _ in range(3))
        level_tree_attention(q, k, v, plan, 0.3)
        assert len(seen) == calls
