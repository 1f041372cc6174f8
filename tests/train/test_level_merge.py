"""Level attention's two ways of summing parts (`level_merge`): the row-wise merge in the compute
dtype gives the previous whole-row float32 merge's numbers bit for bit on two-level trees, and
stays within bf16 rounding of it on deeper ones; both are exact in float64 (the dense-mask
tests in test_level_attention.py run the default)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from grpo_agent.train import level_merge
from grpo_agent.train.level_attention import LevelPlan, level_tree_attention
from grpo_agent.train.packing import pack_row

from .conftest import make_sample
from .test_level_attention import _deep_tree_samples, assert_exact_against_dense_mask


def _two_level_samples():
    gen = torch.Generator().manual_seed(3)
    samples = []
    for group in range(3):
        prompt = torch.randint(1, 90, (7 + group,), generator=gen).tolist()
        for i in range(3):
            comp = torch.randint(1, 90, (3 + 2 * i,), generator=gen).tolist()
            samples.append(make_sample(prompt + comp, [0] * len(prompt) + [1] * len(comp),
                                       group_id=group))
    return samples


def _run(plan, merge, dtype, seed=0):
    """out, dq, dk, dv of `plan` merged by `merge`, on inputs drawn from `seed` (4 q / 2 kv)."""
    n = int(plan.self_cu[-1])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 8, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(1, 2, n, 8, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(1, n, 4, 8, generator=gen).to(dtype)
    out = level_tree_attention(q, k, v, dataclasses.replace(plan, merge=merge), 0.3)
    out.backward(grad)
    return [out, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dense", ["off", "reference"])
def test_rows_merge_equals_the_float32_merge_bit_for_bit_on_two_levels(dense):
    """bf16, prompts -> completions: every row is in at most one depth part, so both sum in
    float32 and round once. `dense="reference"` runs the self part as padded batches too (the
    merge then starts from zeros)."""
    plan = LevelPlan.build(pack_row(_two_level_samples()), "cpu", "reference", dense=dense)
    assert len(plan.query_index) == 1
    for seed in range(3):
        rows, full = _run(plan, "rows", torch.bfloat16, seed), _run(plan, "float32",
                                                                   torch.bfloat16, seed)
        for name, a, b in zip(("out", "dq", "dk", "dv"), rows, full):
            assert a.dtype == torch.bfloat16
            assert torch.equal(a, b), name


def test_rows_merge_stays_within_bf16_rounding_on_deeper_trees():
    """Three levels: rows in two depth parts are rounded twice instead of once."""
    plan = LevelPlan.build(pack_row(_deep_tree_samples()), "cpu", "reference")
    assert len(plan.query_index) == 2
    exact = _run(plan, "float32", torch.float64)
    for name, a, b in zip(("out", "dq", "dk", "dv"), _run(plan, "rows", torch.bfloat16), exact):
        err = float((a.detach().double() - b).norm() / b.norm())
        assert err < 1e-2, (name, err)


def test_both_merges_are_exact_in_float64_on_a_deep_tree(monkeypatch):
    row = pack_row(_deep_tree_samples())
    for merge in level_merge.MERGES:
        monkeypatch.setattr(level_merge, "MERGE", merge)
        plan = LevelPlan.build(row, "cpu", "reference")
        assert plan.merge == merge
        assert_exact_against_dense_mask(row, plan)


def test_unknown_merge_is_rejected(monkeypatch):
    monkeypatch.setattr(level_merge, "MERGE", "bf16")
    with pytest.raises(ValueError, match="choose one of"):
        LevelPlan.build(pack_row(_two_level_samples()), "cpu", "reference")
