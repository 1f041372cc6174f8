"""Samples keep their values through the compact top-k form, the queue's pickling and packing.

The rollout side now sends top-k sampler log-probs as arrays (`grpo_agent.top_logprobs`), the
packer reads them by position and reuses the step planner's trie: the packed row must be the
one the per-token dicts gave, field by field, and the values the server sent must arrive.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import random

import numpy as np
import pytest
import torch
from grpo_agent.rollout.reconcile import reconcile_turns
from grpo_agent.top_logprobs import TopLogprobs
from grpo_agent.train.batching import StepPlanner
from grpo_agent.train.packing import pack_row
from grpo_agent.types import TrainingSample, TrainingSequence, TurnRecord


def _top(gen: random.Random, k: int) -> dict[int, float]:
    return {gen.randrange(1, 5000): -gen.random() * 7 for _ in range(k)}


def _samples(gen: random.Random) -> list[TrainingSample]:
    """Two groups sharing prompts; top-k widths vary (a short row, an empty one, none at all)."""
    samples = []
    for group in range(2):
        prompt = [gen.randrange(1, 5000) for _ in range(7)]
        for i in range(4):
            completion = [gen.randrange(1, 5000) for _ in range(5 + i)]
            top = [None] * len(prompt) + [_top(gen, 3 if t % 4 else 2) for t in range(len(completion))]
            if i == 1:
                top[len(prompt) + 1] = {}  # the server sent no alternatives for this token
            samples.append(TrainingSample(
                TrainingSequence(prompt + completion, [0] * len(prompt) + [1] * len(completion),
                                 [0.0] * len(prompt) + [-gen.random() for _ in completion],
                                 None if (group, i) == (1, 3) else top),
                advantage=gen.uniform(-1, 1), model_version=0, group_id=group, row_index=group))
    return samples


def _compact(samples: list[TrainingSample]) -> list[TrainingSample]:
    out = []
    for s in samples:
        top = s.sequence.sampler_top_logprobs
        seq = dataclasses.replace(s.sequence, sampler_top_logprobs=None if top is None
                                  else TopLogprobs.from_dicts(top))
        out.append(dataclasses.replace(s, sequence=seq))
    return out


def _expected_topk(samples: list[TrainingSample]) -> tuple[list[list[int]], list[list[float]]]:
    """The packed top-k by definition: per trained token (row order), its dict, padded."""
    rows = []
    for s in samples:
        seq = s.sequence
        for t in range(1, len(seq.token_ids)):
            if seq.trained_mask[t]:
                rows.append((seq.sampler_top_logprobs or [None] * len(seq.token_ids))[t] or {})
    width = max(len(r) for r in rows)
    ids = [[*r.keys(), *[-1] * (width - len(r))] for r in rows]
    lps = [[*r.values(), *[-math.inf] * (width - len(r))] for r in rows]
    return ids, lps


def _assert_rows_equal(a, b) -> None:
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), field.name
        else:
            assert x == y, field.name


def test_top_logprobs_arrive_with_the_values_sent():
    gen = random.Random(3)
    rows = [None, {}, _top(gen, 3), _top(gen, 1), None, _top(gen, 3)]
    top = pickle.loads(pickle.dumps(TopLogprobs.from_dicts(rows)))
    assert list(top) == [None, None, rows[2], rows[3], None, rows[5]]  # float64: bit for bit
    assert top == rows and len(top) == len(rows)
    ids, lps = top.rows(np.array([3]))
    assert ids.shape == (1, 1) and lps.tolist() == [list(rows[3].values())]


def test_packed_row_is_the_same_from_arrays_as_from_dicts():
    samples = _samples(random.Random(11))
    queued = [pickle.loads(pickle.dumps(s)) for s in _compact(samples)]  # the queue's way
    from_dicts, from_arrays = pack_row(samples), pack_row(queued)
    _assert_rows_equal(from_dicts, from_arrays)
    ids, lps = _expected_topk(samples)
    assert from_arrays.sampler_topk_ids.tolist() == ids
    assert from_arrays.sampler_topk_logprobs.tolist() == torch.tensor(lps, dtype=torch.float32).tolist()


def test_a_row_without_any_top_k_has_none():
    samples = _samples(random.Random(5))
    for s in samples:
        s.sequence.sampler_top_logprobs = None
    row = pack_row(_compact(samples))
    assert row.sampler_topk_ids is None and row.sampler_topk_logprobs is None


def test_ids_and_logprobs_of_different_shapes_are_refused():
    """Packing indexes both arrays by position: a mismatch would pair ids with wrong log-probs."""
    with pytest.raises(ValueError, match=r"one \[tokens, k\] shape, got \(3, 2\) and \(3, 1\)"):
        TopLogprobs(np.zeros((3, 2), dtype=np.int32), np.zeros((3, 1)))
    with pytest.raises(ValueError, match=r"one \[tokens, k\] shape"):
        TopLogprobs(np.zeros(3, dtype=np.int32), np.zeros(3))


def test_planner_packs_the_row_a_fresh_trie_packs():
    samples = _compact(_samples(random.Random(2)))
    planner = StepPlanner(token_budget=10_000, num_processes=1, grad_accum_steps=1)
    for s in samples:
        assert planner.add(s)
    planned = planner.plan().microbatches[0][0]
    _assert_rows_equal(planned, pack_row(copy.deepcopy(samples)))


def test_reconciled_sequences_carry_arrays_with_the_turns_values():
    gen = random.Random(4)
    tops = [_top(gen, 3) for _ in range(4)]
    turn = TurnRecord(prompt_ids=[1, 2, 3], output_ids=[7, 8, 9, 10],
                      output_log_probs=[-0.5, -0.25, -1.5, -2.0], output_sampler_logprobs=tops)
    (sequence,), _ = reconcile_turns([turn])
    assert isinstance(sequence.sampler_top_logprobs, TopLogprobs)
    assert list(sequence.sampler_top_logprobs) == [None, None, None, *tops]
