"""CUDA: the FlexAttention, flash-varlen and level tree paths equal unpacked attention (log-probs
and gradients); the compiled LM-head tiles equal the eager ones."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from grpo_agent.train import flash_impl
from grpo_agent.train.forward import forward_row
from grpo_agent.train.level_attention import LevelPlan, level_tree_attention
from grpo_agent.train.loss import LossConfig, row_loss
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import enable_tree_attention
from grpo_agent.train.varlen_attention import (
    VarlenPlan,
    sdpa_varlen,
    torch_flash_varlen,
    tree_varlen_attention,
)

from .conftest import make_sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _unpacked(model, samples):
    out = []
    for s in samples:
        ids = torch.tensor([s.sequence.token_ids], device="cuda")
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        out += [
            logp[t - 1, tok]
            for t, (tok, m) in enumerate(zip(s.sequence.token_ids, s.sequence.trained_mask))
            if m and t > 0
        ]
    return torch.stack(out)


def test_flex_tree_attention_matches_unpacked(tiny_qwen3, shared_samples):
    torch.backends.cuda.matmul.allow_tf32 = False
    plain = tiny_qwen3.cuda()
    packed = copy.deepcopy(plain)
    enable_tree_attention(packed)
    row = pack_row(shared_samples)
    got = forward_row(packed, row, temperature=1.0, backend="flex").token.logprobs
    ref = _unpacked(plain, shared_samples)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    w = torch.randn(ref.shape, device="cuda")
    (got * w).sum().backward()
    (ref * w).sum().backward()
    for (name, a), (_, b) in zip(packed.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=name)


def _big_shared_row(group_size=6, groups=3, prompt=300, vocab=96):
    """Groups sharing long prompts (segments longer than one flash tile), then a multi-turn
    group whose untrained history forks twice: a tree three segments deep."""
    gen = torch.Generator().manual_seed(5)

    def tokens(n):
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    samples = []
    for g in range(groups):
        head = tokens(prompt)
        for i in range(group_size):
            comp = tokens(40 + 37 * i)
            samples.append(make_sample(head + comp, [0] * prompt + [1] * len(comp), group_id=g))
    head, turn = tokens(170), tokens(90)
    for i, history in enumerate([head + turn, head + turn, head]):
        comp = tokens(60 + 50 * i)
        samples.append(make_sample(history + comp, [0] * len(history) + [1] * len(comp),
                                   group_id=groups))
    return pack_row(samples)


def _assert_matches_reference(attend, n, dtype, device="cuda"):
    """attend(q, k, v, fast) over a row of n tokens (8 query heads over 2 key/value heads):
    the fast kernel in `dtype` against the reference in float32; out, dq, dk, dv."""
    q = torch.randn(1, 8, n, 64, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, n, 64, device=device, dtype=dtype) for _ in range(2))
    grad = torch.randn(1, n, 8, 64, device=device, dtype=dtype)

    def run(fast, cast):
        inputs = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        out = attend(*inputs, fast)
        out.backward(grad.to(cast))
        return [out, *(t.grad for t in inputs)]

    got, ref = run(True, dtype), run(False, torch.float32)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, ref):
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_flash_varlen_matches_the_reference_on_a_tree(dtype):
    """PyTorch's flash kernel on gathered paths: bottom-right causal, GQA, gradients through
    the gather, against the per-segment SDPA reference in float32."""
    row = _big_shared_row()
    plan = VarlenPlan.build(row, "cuda", torch_flash_varlen)
    assert plan.kv_index is not None and plan.max_k > plan.max_q

    def attend(q, k, v, fast):
        kernel = torch_flash_varlen if fast else sdpa_varlen
        return tree_varlen_attention(q, k, v, dataclasses.replace(plan, kernel=kernel), 0.125)

    _assert_matches_reference(attend, row.num_tokens, dtype)


@pytest.mark.parametrize("merge", ["rows", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_level_attention_on_flash_matches_the_reference(dtype, merge):
    """The level split on PyTorch's flash kernels (merge by log-sum-exp; each part's backward
    from the merged output) against the same split in float32 plain math, which the CPU tests
    hold to the dense tree mask; parts summed on their rows (`level_merge`) or the whole row."""
    row = _big_shared_row()
    plan = dataclasses.replace(LevelPlan.build(row, "cuda", "flash", dense="off"), merge=merge)
    assert len(plan.query_index) == 2  # prompts -> completions, and a second fork

    def attend(q, k, v, fast):
        kernel = "flash" if fast else "reference"
        return level_tree_attention(q, k, v, dataclasses.replace(plan, kernel=kernel), 0.125)

    _assert_matches_reference(attend, row.num_tokens, dtype)


@pytest.mark.parametrize("path", ["varlen", "levels"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashattention_4_behind_torch_flash_ops_matches_the_reference(dtype, path):
    """With flash-attn-4 installed (Hopper/Blackwell), torch's flash ops run its kernels: both
    tree paths still equal the float32 reference, log-sum-exps (the level merge) included."""
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")
    before = flash_impl.active()
    flash_impl.use("FA4")
    try:
        assert flash_impl.active() == "FA4"
        if path == "varlen":
            test_torch_flash_varlen_matches_the_reference_on_a_tree(dtype)
        else:
            test_level_attention_on_flash_matches_the_reference(dtype, "rows")
    finally:
        flash_impl.use(before)


@pytest.mark.parametrize("backend", ["varlen", "levels"])
def test_flash_tree_paths_match_unpacked_in_bf16(tiny_qwen3, shared_samples, backend):
    reference = tiny_qwen3.cuda()  # float32, unpacked
    ref = _unpacked(reference, shared_samples)
    packed = copy.deepcopy(reference).to(torch.bfloat16)
    enable_tree_attention(packed)
    row = pack_row(shared_samples)
    got = forward_row(packed, row, temperature=1.0, backend=backend).token.logprobs
    flex = forward_row(packed, row, temperature=1.0, backend="flex").token.logprobs
    err, flex_err = (got - ref).abs().max().item(), (flex - ref).abs().max().item()
    assert err < 0.1 and err < 2 * flex_err + 1e-2, (err, flex_err)
    got.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in packed.parameters() if p.grad is not None)


def test_row_loss_runs_on_cuda_in_bf16(tiny_qwen3, shared_samples):
    model = tiny_qwen3.cuda().to(torch.bfloat16)
    enable_tree_attention(model)
    row = pack_row(shared_samples)
    loss, metrics = row_loss(model, row, LossConfig(), num_trained_tokens_global=row.num_trained)
    loss.backward()
    assert torch.isfinite(loss.float()) and metrics["sampling/sampling_logp_difference/mean"] > 0
    assert any(p.grad is not None and p.grad.float().abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("backend", ["varlen", "levels"])
def test_rows_queue_without_waiting_for_the_gpu(tiny_qwen3, shared_samples, backend):
    """A row's loss and backward never make the host wait for the GPU (no pageable copies, no
    reads), so the trainer's next row is queued while this one runs."""
    model = tiny_qwen3.cuda().to(torch.bfloat16)
    enable_tree_attention(model)
    rows = [pack_row(shared_samples), pack_row(shared_samples[1:])]
    cfg = LossConfig()
    for row in rows:  # warm-up: lazy CUDA initialisation (handles, pinned pool) may sync
        row_loss(model, row, cfg, num_trained_tokens_global=row.num_trained)[0].backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for row in reversed(rows):
            loss, _ = row_loss(model, row, cfg, num_trained_tokens_global=row.num_trained)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("temperature,masked", [(1.0, False), (0.7, True)])
def test_compiled_lm_head_matches_eager(monkeypatch, temperature, masked):
    """The compiled per-tile functions compute what the eager ones do (bf16, several tiles)."""
    from grpo_agent.train import compiled_or_eager, logprobs

    tokens, hidden_size, vocab = 300, 256, 5000
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.05
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    candidates = None
    if masked:
        candidates = torch.randint(0, vocab, (tokens, 64), device="cuda")
        candidates[:, 0], candidates[:, -5:] = targets, -1

    def run(compiled: bool):
        monkeypatch.setattr(compiled_or_eager, "COMPILE_ON_CUDA", compiled)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = logprobs.token_logprobs(
            h, w, targets, temperature=temperature, candidates=candidates, tile=1024
        )
        out.logprobs.float().sum().backward()
        return out.logprobs, out.entropy, h.grad, w.grad

    got, ref = run(True), run(False)
    assert not logprobs.tile_stats.failed and not logprobs.tile_grad.failed
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    for a, b in zip(got[2:], ref[2:]):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("merge", ["rows", "float32"])
@pytest.mark.parametrize("compiler", ["eager", "aot_eager", "inductor"])
def test_compiled_level_attention_matches_eager(compiler, merge):
    """Compiled (dynamo's graph, AOT autograd, inductor), the level split's out and dq/dk/dv
    equal the eager split's. Traced as an autograd.Function they did not (dq, dk, dv zero
    with the rows merge under every backend; 12-15x off with the float32 merge under
    inductor): the split is now one custom op with a backward op."""
    row = _big_shared_row()
    plan = dataclasses.replace(LevelPlan.build(row, "cuda", "flash", dense="off"), merge=merge)
    n = row.num_tokens
    # the layout a decoder layer hands over: [1, heads, N, dim] views of [1, N, heads, dim]
    q = torch.randn(1, n, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(1, n, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for _ in range(2))
    grad = torch.randn(1, n, 8, 64, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(level_tree_attention, backend=compiler, fullgraph=True)

    def run(attend):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs, plan, 0.125)
        out.backward(grad)
        return [out, *(t.grad for t in inputs)]

    for name, a, b in zip(["out", "dq", "dk", "dv"], run(compiled), run(level_tree_attention)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


def _groups_row(groups=3, group_size=5, prompt=300, vocab=96):
    """Groups whose prompts have one length: every level part pads into a dense batch."""
    gen = torch.Generator().manual_seed(7)
    samples = []
    for g in range(groups):
        head = torch.randint(1, vocab, (prompt,), generator=gen).tolist()
        for i in range(group_size):
            comp = torch.randint(1, vocab, (30 + 41 * i,), generator=gen).tolist()
            samples.append(make_sample(head + comp, [0] * prompt + [1] * len(comp), group_id=g))
    return pack_row(samples)


@pytest.mark.parametrize("merge", ["rows", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dense,groups_only", [("cudnn", False), ("cudnn", True),
                                               ("cudnn-depth", True)])
def test_level_attention_dense_parts_on_cudnn_match_the_reference(dtype, dense, groups_only,
                                                                  merge):
    """Padded level parts on cuDNN's SDPA kernel (the self part by length groups or on flash;
    the prompt part dense where prompts have one length) against the float32 reference of the
    same plan, which the CPU tests hold to the dense tree mask; both `level_merge` sums."""
    from grpo_agent.train import cudnn_attention

    assert cudnn_attention.usable(torch.device("cuda"), torch.bfloat16), \
        cudnn_attention.PROBE_NOTES
    row = _groups_row() if groups_only else _big_shared_row()
    plan = dataclasses.replace(LevelPlan.build(row, "cuda", "flash", dense=dense), merge=merge)
    assert (plan.self_dense is not None and len(plan.self_dense) >= 2) == (dense == "cudnn")
    assert (plan.depth_dense[0] is not None) == groups_only

    def attend(q, k, v, fast):
        exact = dataclasses.replace(plan, kernel="reference", dense_kernel="reference")
        return level_tree_attention(q, k, v, plan if fast else exact, 0.125)

    _assert_matches_reference(attend, row.num_tokens, dtype)


@pytest.mark.parametrize("backend", ["varlen", "levels", "masked"])
def test_row_graphs_replay_the_eager_step(tiny_qwen3, shared_samples, monkeypatch, backend):
    """CUDA graphs over bucketed rows (`row_graphs`), on every captured tree path (masked:
    FlashAttention 4, skipped without it): three buckets sharing one pool, captured largest
    first, replayed in another order; each replay reads its own row, log-probs and the
    accumulated gradients match the eager step of the same path in bf16 (the warm-ups added
    nothing), a gradient reset re-attaches, and a replay never makes the host wait for the
    GPU."""
    from grpo_agent.train import row_graphs
    from grpo_agent.train.row_graphs import RowGraphs

    if backend == "masked" and flash_impl.fa4_kernels_missing(torch.device("cuda")):
        pytest.skip(flash_impl.fa4_kernels_missing(torch.device("cuda")))

    def loss(token, tensors):
        return (token.logprobs * tensors["advantages"] * tensors["valid"]).sum()

    monkeypatch.setitem(row_graphs.STEPS, "tokens", 16)
    model = tiny_qwen3.cuda().to(torch.bfloat16)
    enable_tree_attention(model)
    rows = [pack_row(shared_samples), pack_row(shared_samples[3:]), pack_row(shared_samples[:2])]
    order = [rows[2], rows[0], rows[1], rows[2]]

    def eager(steps):
        model.zero_grad(set_to_none=True)
        lps = []
        for row in steps:
            lp = forward_row(model, row, temperature=1.0, backend=backend).token.logprobs
            (lp * row.advantages.cuda()).sum().backward()
            lps.append(lp.detach().float())
        del lp  # a live autograd graph pins its AccumulateGrad nodes to the default stream
        grads = [p.grad.float() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return lps, grads

    def check(got, refs, ref_grads):
        for g, ref in zip(got, refs):
            assert g.shape == ref.shape and (g - ref).abs().max().item() < 2e-2
        for (name, p), ref in zip(model.named_parameters(), ref_grads):
            rel = ((p.grad.float() - ref).norm() / ref.norm()).item()
            assert rel < 2e-2, (name, rel)

    refs, ref_grads = eager(order)
    alone = eager([rows[1]])
    graphs = RowGraphs(model, loss, backend=backend)
    graphs.prepare(rows)  # warm-ups, then captures, largest first
    assert len(graphs.graphs) == 3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [graphs.step(row).token.logprobs.float().clone() for row in order]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(got, refs, ref_grads)
    model.zero_grad(set_to_none=True)
    check([graphs.step(rows[1]).token.logprobs.float().clone()], *alone)
