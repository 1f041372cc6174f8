"""Row graphs (`row_graphs`): the padded, bucketed step that a CUDA graph captures equals the
unpadded tree step on CPU (float64: log-probs and every parameter gradient), on every captured
tree path (varlen; levels and masked through their reference kernels), across rows of one
bucket and across gradient resets; a replaced `.grad` is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_agent.train import row_graphs
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.row_graphs import Bucket, RowGraphs, padded_inputs
from grpo_agent.train.tree_attention import enable_tree_attention

from .test_level_attention import _deep_tree_samples


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    """Buckets sized for the tiny rows: padding still on every axis, little work on CPU."""
    monkeypatch.setattr(row_graphs, "STEPS",
                        {"tokens": 128, "segments": 16, "keys": 256, "trained": 64, "seqlen": 256,
                         "rows": 64})


def _loss(token, tensors):
    return (token.logprobs * tensors["advantages"] * tensors["valid"]).sum()


@pytest.fixture
def model(tiny_qwen3):
    packed = copy.deepcopy(tiny_qwen3).double()
    enable_tree_attention(packed)
    return packed


def _reference(model, rows, backend="varlen"):
    """Log-probs per row and the gradients accumulated over the rows, unpadded, on the tree
    path `backend` captures (varlen through the eager gather; the model's RMSNorm rounds to
    float32, so two paths equal to 1e-16 differ by float32 roundings after it)."""
    model.zero_grad(set_to_none=True)
    lps = []
    for row in rows:
        lp = forward_row(model, row, temperature=1.0,
                         backend="gather" if backend == "varlen" else backend).token.logprobs
        (lp * row.advantages.double()).sum().backward()
        lps.append(lp.detach())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return lps, grads


def _assert_grads(model, grads):
    for (name, p), ref in zip(model.named_parameters(), grads):
        torch.testing.assert_close(p.grad, ref, atol=1e-12, rtol=1e-9, msg=name)


BACKENDS = pytest.mark.parametrize("backend", row_graphs.BACKENDS)


@pytest.mark.parametrize(("backend", "deep"), [("varlen", False), ("levels", False),
                                              ("levels", True), ("masked", True)])
def test_padded_step_equals_the_unpadded_row(model, shared_samples, backend, deep):
    """deep: three levels, so two depth parts, each with its padding pair."""
    row = pack_row(_deep_tree_samples() if deep else shared_samples)
    (ref_lp,), grads = _reference(model, [row], backend)
    graphs = RowGraphs(model, _loss, capture=False, backend=backend)
    got = graphs.step(row).token.logprobs
    assert got.shape == ref_lp.shape
    torch.testing.assert_close(got, ref_lp, atol=1e-12, rtol=0)
    _assert_grads(model, grads)


@BACKENDS
def test_rows_of_one_bucket_reuse_its_buffers_and_accumulate(model, shared_samples, backend):
    rows = [pack_row(shared_samples), pack_row(shared_samples[1:]), pack_row(shared_samples[:4])]
    if backend == "levels":  # rows of one bucket need the same number of depths
        rows = [pack_row(shared_samples[:6]), pack_row(shared_samples[1:6]),
                pack_row(shared_samples[:4])]
    assert len({Bucket.of(r, backend) for r in rows}) == 1
    assert rows[0].num_tokens != rows[1].num_tokens
    ref_lps, grads = _reference(model, rows, backend)
    graphs = RowGraphs(model, _loss, capture=False, backend=backend)
    graphs.step(rows[2])  # then reset, as an optimizer step's zero_grad does
    model.zero_grad(set_to_none=True)
    for row, ref in zip(rows, ref_lps):
        torch.testing.assert_close(graphs.step(row).token.logprobs, ref, atol=1e-12, rtol=0)
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


def test_masked_padding_is_one_causal_segment_after_the_row(shared_samples):
    """masked: the real keys keep the row's `until` (none reaches a padding query), each padding
    key is seen up to the bucket's end (by itself and the padding queries after it), and the
    bucket is the token and trained-entry counts only."""
    from grpo_agent.train.tree_attention import visible_until

    row = pack_row(shared_samples)
    bucket = Bucket.of(row, "masked")
    assert (bucket.segments, bucket.max_q, bucket.keys, bucket.depths) == (0, 0, 0, ())
    until = padded_inputs(row, bucket)["until"]
    n = row.num_tokens
    assert until.dtype == torch.int32 and until.numel() == bucket.tokens > n
    assert (until[:n] == visible_until(row.segment_ids, row.segment_ancestors)).all()
    assert until[:n].max() <= n and (until[n:] == bucket.tokens).all()
    other = pack_row(shared_samples[1:])
    assert other.num_tokens != n and Bucket.of(other, "masked") == bucket


def test_auto_takes_masked_where_the_eager_auto_does(model, shared_samples, monkeypatch):
    from grpo_agent.train import tree_attention

    row = pack_row(shared_samples)
    graphs = RowGraphs(model, _loss, capture=False, backend="auto")
    assert graphs.bucket(row).backend == "varlen"  # CPU: auto answers gather
    seen = []

    def choose(device, dtype, tokens, head_dim):
        seen.append((tokens, head_dim))
        return "masked"

    monkeypatch.setattr(tree_attention, "choose_backend", choose)
    assert graphs.bucket(row).backend == "masked"
    assert seen == [(row.num_tokens, model.config.head_dim)]


def test_replaced_gradients_are_refused(model, shared_samples):
    row = pack_row(shared_samples)
    graphs = RowGraphs(model, _loss, capture=False)
    graphs.step(row)
    first = next(model.parameters())
    first.grad = torch.zeros_like(first)
    with pytest.raises(RuntimeError, match="zero_grad"):
        graphs.step(row)


@BACKENDS
def test_warm_ups_of_new_buckets_add_nothing_to_accumulated_gradients(
        model, shared_samples, monkeypatch, backend):
    """`prepare` runs each new bucket's warm-up step with `valid` 0 in the middle of an
    accumulation: the gradients so far are unchanged, and the rows then step as unpadded."""
    monkeypatch.setitem(row_graphs.STEPS, "tokens", 16)
    rows = [pack_row(shared_samples), pack_row(shared_samples[3:]), pack_row(shared_samples[:2])]
    assert len({Bucket.of(r, backend) for r in rows}) == 3
    ref_lps, grads = _reference(model, rows, backend)
    (_, first_grads) = _reference(model, rows[:1], backend)
    graphs = RowGraphs(model, _loss, capture=False, backend=backend)
    torch.testing.assert_close(graphs.step(rows[0]).token.logprobs, ref_lps[0], atol=1e-12, rtol=0)
    graphs.prepare(rows)
    assert len(graphs.buffers) == 3
    _assert_grads(model, first_grads)
    for row, ref in zip(rows[1:], ref_lps[1:]):
        torch.testing.assert_close(graphs.step(row).token.logprobs, ref, atol=1e-12, rtol=0)
    _assert_grads(model, grads)


def test_level_padding_pairs_hold_padding_rows_only(monkeypatch):
    """levels: the self part's padding segment covers the padding tokens; each depth part
    keeps its real pairs as the plan has them and ends with one padding pair of padding
    query and key rows (both non-empty), then empty pairs."""
    from grpo_agent.train.level_attention import LevelPlan

    monkeypatch.setitem(row_graphs.STEPS, "segments", 64)
    row = pack_row(_deep_tree_samples())
    bucket = Bucket.of(row, "levels")
    plan = LevelPlan.build(row, "cpu", "reference", dense="off")
    assert len(bucket.depths) == len(plan.query_index) >= 2
    t = padded_inputs(row, bucket)
    segments = len(row.segment_paths)
    assert t["cu_q"][segments] == row.num_tokens and (t["cu_q"][segments + 1:] == bucket.tokens).all()
    for d, shape in enumerate(bucket.depths):
        real_q, real_k = plan.query_index[d].numel(), plan.key_index[d].numel()
        q, k, cu_q, cu_k = (t[f"depth{d}_{n}"] for n in ("q", "k", "cu_q", "cu_k"))
        assert (q[:real_q] == plan.query_index[d]).all() and (k[:real_k] == plan.key_index[d]).all()
        assert q.numel() == shape.queries > real_q and k.numel() == shape.keys > real_k
        assert (q[real_q:] >= row.num_tokens).all() and (k[real_k:] >= row.num_tokens).all()
        pairs = plan.cu_q[d].numel() - 1
        assert (cu_q[: pairs + 1] == plan.cu_q[d]).all() and (cu_k[: pairs + 1] == plan.cu_k[d]).all()
        assert cu_q[pairs + 1] == shape.queries and cu_k[pairs + 1] == shape.keys
        assert (cu_q[pairs + 1:] == shape.queries).all() and (cu_k[pairs + 1:] == shape.keys).all()
        assert cu_q.numel() == shape.pairs + 1


@pytest.mark.parametrize("backend", ["varlen", "levels"])
@pytest.mark.parametrize("longest", ["padding tokens", "padding rows of a depth part"])
def test_flash_bounds_cover_every_padded_range(monkeypatch, shared_samples, backend, longest):
    """max_q / max_k are what flash kernels size their grids by (CPU's stand-in ignores them):
    every padded range, the padding's own included, must fit. Fine seqlen steps, and coarse
    token (or depth-part row) buckets that make a padding range the longest one."""
    coarse = {"tokens": 1024} if longest == "padding tokens" else {"tokens": 1, "rows": 1024}
    monkeypatch.setattr(row_graphs, "STEPS", {**row_graphs.STEPS, "seqlen": 1, **coarse})
    row = pack_row(shared_samples)
    bucket = Bucket.of(row, backend)
    t = padded_inputs(row, bucket)
    if longest == "padding tokens":
        assert bucket.tokens - row.num_tokens > max(torch.bincount(row.segment_ids).tolist())
    assert int(t["cu_q"].diff().max()) <= bucket.max_q
    if backend == "varlen":
        assert int(t["cu_k"].diff().max()) <= bucket.max_k
    for d, shape in enumerate(bucket.depths):
        assert int(t[f"depth{d}_cu_q"].diff().max()) <= shape.max_q
        assert int(t[f"depth{d}_cu_k"].diff().max()) <= shape.max_k


@pytest.mark.parametrize("score_centering", [True, False])
def test_the_trainers_graph_loss_is_the_eager_row_loss(model, shared_samples, score_centering):
    """`cuda_graphs=True` trains through `loss.padded_policy_loss` over the bucket's padded
    entries, and the trainer's tests of it need a GPU. On CPU: its padded step gives the loss
    and gradients of `row_loss` on the same row (the sampler's log-probs, score centering's
    top-k term, the temperature), the padded entries adding nothing."""
    from grpo_agent.train.loss import LossConfig, padded_policy_loss, row_loss

    # clip_min below the padded entries' ratios (about 1/vocab): only their zero advantage keeps
    # them out of the loss
    cfg = LossConfig(score_centering=score_centering, temperature=0.7, clip_min=1e-3, clip_max=3.0)
    row = pack_row(shared_samples)
    model.zero_grad(set_to_none=True)
    ref, _ = row_loss(model, row, cfg, num_trained_tokens_global=row.num_trained)
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert max(g.abs().max().item() for g in grads) > 1e-3  # not a comparison of zeros
    model.zero_grad(set_to_none=True)
    graphs = RowGraphs(model, padded_policy_loss(cfg), temperature=cfg.temperature, capture=False)
    assert graphs.bucket(row).trained > row.num_trained  # padded entries take part
    step = graphs.step(row, scale=1.0 / row.num_trained)
    # log-probs are float32 on either path (`logprobs.gathered_logits`)
    torch.testing.assert_close(step.loss, ref.detach(), atol=1e-7, rtol=1e-5)
    for (name, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(p.grad, g, atol=1e-7, rtol=1e-5, msg=name)
