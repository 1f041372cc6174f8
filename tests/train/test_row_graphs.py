"""Row graphs (`row_graphs`): the padded, bucketed step that a CUDA graph captures equals the
unpadded tree step on CPU (float64: log-probs and every parameter gradient), across rows of
one bucket and across gradient resets; a replaced `.grad` is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_agent.train import row_graphs
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.row_graphs import Bucket, RowGraphs, padded_inputs
from grpo_agent.train.tree_attention import enable_tree_attention


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    """Buckets sized for the tiny rows: padding still on every axis, little work on CPU."""
    monkeypatch.setattr(row_graphs, "STEPS",
                        {"tokens": 128, "segments": 16, "keys": 256, "trained": 64, "seqlen": 256})


def _loss(token, tensors):
    return (token.logprobs * tensors["advantages"] * tensors["valid"]).sum()


@pytest.fixture
def model(tiny_qwen3):
    packed = copy.deepcopy(tiny_qwen3).double()
    enable_tree_attention(packed)
    return packed


def _reference(model, rows):
    """Log-probs per row and the gradients accumulated over the rows, unpadded."""
    model.zero_grad(set_to_none=True)
    lps = []
    for row in rows:
        lp = forward_row(model, row, temperature=1.0, backend="gather").token.logprobs
        (lp * row.advantages.double()).sum().backward()
        lps.append(lp.detach())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return lps, grads


def _assert_grads(model, grads):
    for (name, p), ref in zip(model.named_parameters(), grads):
        torch.testing.assert_close(p.grad, ref, atol=1e-12, rtol=1e-9, msg=name)


def test_padded_step_equals_the_unpadded_row(model, shared_samples):
    row = pack_row(shared_samples)
    (ref_lp,), grads = _reference(model, [row])
    graphs = RowGraphs(model, _loss, capture=False)
    got = graphs.step(row)
    assert got.shape == ref_lp.shape
    torch.testing.assert_close(got, ref_lp, atol=1e-12, rtol=0)
    _assert_grads(model, grads)


def test_rows_of_one_bucket_reuse_its_buffers_and_accumulate(model, shared_samples):
    rows = [pack_row(shared_samples), pack_row(shared_samples[1:]), pack_row(shared_samples[:4])]
    assert len({Bucket.of(r) for r in rows}) == 1 and rows[0].num_tokens != rows[1].num_tokens
    ref_lps, grads = _reference(model, rows)
    graphs = RowGraphs(model, _loss, capture=False)
    graphs.step(rows[2])  # then reset, as an optimizer step's zero_grad does
    model.zero_grad(set_to_none=True)
    for row, ref in zip(rows, ref_lps):
        torch.testing.assert_close(graphs.step(row), ref, atol=1e-12, rtol=0)
    assert len(graphs.buffers) == 1
    _assert_grads(model, grads)


def test_padding_keys_are_only_seen_by_padding(shared_samples, monkeypatch):
    """The plan's last real segment ends at the row's last token; the padding segment's keys
    are padding rows; the empty segments add no queries and no keys."""
    monkeypatch.setitem(row_graphs.STEPS, "segments", 64)
    row = pack_row(shared_samples)
    bucket = Bucket.of(row)
    t = padded_inputs(row, bucket)
    segments = len(row.segment_paths)
    assert t["cu_q"][segments] == row.num_tokens and t["cu_q"][-1] == bucket.tokens
    assert (t["cu_q"][segments + 1:] == bucket.tokens).all()
    start, stop = t["cu_k"][segments], t["cu_k"][segments + 1]
    assert (t["kv_index"][start:stop] >= row.num_tokens).all()
    assert stop == bucket.keys and (t["cu_k"][segments + 1:] == bucket.keys).all()
    assert (t["kv_index"][stop - (bucket.tokens - row.num_tokens):stop]
            == torch.arange(row.num_tokens, bucket.tokens)).all()
    assert t["valid"].sum() == row.num_trained and t["valid"].numel() == bucket.trained


def test_replaced_gradients_are_refused(model, shared_samples):
    row = pack_row(shared_samples)
    graphs = RowGraphs(model, _loss, capture=False)
    graphs.step(row)
    first = next(model.parameters())
    first.grad = torch.zeros_like(first)
    with pytest.raises(RuntimeError, match="zero_grad"):
        graphs.step(row)


def test_warm_ups_of_new_buckets_add_nothing_to_accumulated_gradients(
        model, shared_samples, monkeypatch):
    """`prepare` runs each new bucket's warm-up step with `valid` 0 in the middle of an
    accumulation: the gradients so far are unchanged, and the rows then step as unpadded."""
    monkeypatch.setitem(row_graphs.STEPS, "tokens", 16)
    rows = [pack_row(shared_samples), pack_row(shared_samples[3:]), pack_row(shared_samples[:2])]
    assert len({Bucket.of(r) for r in rows}) == 3
    ref_lps, grads = _reference(model, rows)
    (_, first_grads) = _reference(model, rows[:1])
    graphs = RowGraphs(model, _loss, capture=False)
    torch.testing.assert_close(graphs.step(rows[0]), ref_lps[0], atol=1e-12, rtol=0)
    graphs.prepare(rows)
    assert len(graphs.buffers) == 3
    _assert_grads(model, first_grads)
    for row, ref in zip(rows[1:], ref_lps[1:]):
        torch.testing.assert_close(graphs.step(row), ref, atol=1e-12, rtol=0)
    _assert_grads(model, grads)
