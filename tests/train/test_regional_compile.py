"""`torch_compile=True`: compiled decoder layers give the eager log-probs and gradients, and
rows of new lengths reuse the compiled graphs instead of recompiling every step."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.regional_compile import compile_decoder_layers
from grpo_agent.train.tree_attention import enable_tree_attention
from torch._dynamo.testing import CompileCounter


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["gather", "sdpa"])
def test_compiled_layers_match_eager(tiny_qwen3, shared_samples, backend, fresh_dynamo):
    enable_tree_attention(tiny_qwen3)
    compiled = copy.deepcopy(tiny_qwen3)
    counter = CompileCounter()  # traces with dynamo, runs the captured graphs eagerly
    assert compile_decoder_layers(compiled, backend=counter) == 2
    row = pack_row(shared_samples)
    weights = torch.randn(row.targets.shape)
    results = []
    for model in (tiny_qwen3, compiled):
        logprobs = forward_row(model, row, temperature=0.7, backend=backend).token.logprobs
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), _grads(model)))
    (ref, ref_grads), (got, got_grads) = results
    assert counter.frame_count > 0  # the layers really went through dynamo
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)


def test_new_row_lengths_do_not_recompile(tiny_qwen3, shared_samples, fresh_dynamo):
    enable_tree_attention(tiny_qwen3)
    counter = CompileCounter()
    compile_decoder_layers(tiny_qwen3, backend=counter)
    rows = [pack_row(shared_samples[:k]) for k in (3, 5, 7, 8)]
    assert len({row.num_tokens for row in rows}) == 4
    frames = []
    for row in rows:
        forward_row(tiny_qwen3, row, temperature=1.0).token.logprobs.sum().backward()
        frames.append(counter.frame_count)
    # The first length compiles static graphs, the second dynamic ones; after that, none.
    assert frames[2] == frames[1] == frames[3], frames


def test_compiling_twice_keeps_the_first_compilation(tiny_qwen3, fresh_dynamo):
    compile_decoder_layers(tiny_qwen3, backend=CompileCounter())
    first = [layer._compiled_call_impl for layer in tiny_qwen3.model.layers]
    compile_decoder_layers(tiny_qwen3, backend=CompileCounter())
    assert [layer._compiled_call_impl for layer in tiny_qwen3.model.layers] == first


def test_models_without_decoder_layers_get_a_clear_error():
    with pytest.raises(ValueError, match="torch_compile=False"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_inductor_compiled_layers_match_eager(tiny_qwen3, shared_samples, fresh_dynamo):
    """The real compiler (inductor, C++ on CPU) on the packed row: same log-probs and grads."""
    enable_tree_attention(tiny_qwen3)
    compiled = copy.deepcopy(tiny_qwen3)
    compile_decoder_layers(compiled)
    row = pack_row(shared_samples)
    results = []
    for model in (tiny_qwen3, compiled):
        logprobs = forward_row(model, row, temperature=1.0).token.logprobs
        logprobs.sum().backward()
        results.append((logprobs.detach(), _grads(model)))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("torch_compile", [True, False])
def test_trainer_compiles_the_layers_it_runs(tiny_model_path, tmp_path, torch_compile,
                                             fresh_dynamo):
    # transformers' Trainer would wrap the whole model, whose forward this trainer never calls.
    from datasets import Dataset
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), torch_compile=torch_compile,
                           report_to="none")
    trainer = AsyncGRPOTrainer(str(tiny_model_path), reward_funcs="accuracy", args=args,
                               train_dataset=Dataset.from_dict({"prompt": ["1+1"],
                                                                "solution": ["2"]}))
    layers = trainer.model.get_decoder().layers
    assert [layer._compiled_call_impl is not None for layer in layers] == [torch_compile] * len(
        layers)


def test_flex_tree_attention_traced_in_the_layer_reuses_its_graph(tiny_qwen3, shared_samples,
                                                                  fresh_dynamo):
    """The CUDA path: FlexAttention inside the compiled layer, with a new block mask (and
    mask_mod closure) per row. CPU has its forward, enough to check values and recompiles."""
    enable_tree_attention(tiny_qwen3)
    compiled = copy.deepcopy(tiny_qwen3)
    counter = CompileCounter()
    compile_decoder_layers(compiled, backend=counter)
    frames = []
    with torch.no_grad():
        for k in (3, 5, 7, 8):
            row = pack_row(shared_samples[:k])
            ref = forward_row(tiny_qwen3, row, temperature=1.0, backend="sdpa").token.logprobs
            got = forward_row(compiled, row, temperature=1.0, backend="flex").token.logprobs
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
            frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[-1] == frames[1], frames


def _traceable_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale=None, causal=False):
    """The varlen contract in tensor ops only (no per-segment loop), so dynamo can trace it
    the way it traces PyTorch's flash op on CUDA: one masked SDPA over all tokens."""
    cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    rows_q, rows_k = torch.arange(q.shape[0]), torch.arange(k.shape[0])
    seq_q = torch.searchsorted(cu_q, rows_q.to(cu_q.dtype), right=True) - 1
    seq_k = torch.searchsorted(cu_k, rows_k.to(cu_k.dtype), right=True) - 1
    shift = (cu_k[seq_q + 1] - cu_k[seq_q]) - (cu_q[seq_q + 1] - cu_q[seq_q])  # bottom-right
    depth_q, depth_k = rows_q - cu_q[seq_q] + shift, rows_k - cu_k[seq_k]
    mask = (seq_q[:, None] == seq_k[None, :]) & (depth_k[None, :] <= depth_q[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=softmax_scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def test_varlen_tree_attention_traced_in_the_layer_reuses_its_graph(
    monkeypatch, tiny_qwen3, shared_samples, fresh_dynamo
):
    """The CUDA default: the gathered-path varlen call is traced into the compiled layer (no
    graph break), and rows of new lengths and segment counts reuse the graphs."""
    from grpo_agent.train import varlen_attention

    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: _traceable_varlen)
    frames = _compiled_frames_over_rows(tiny_qwen3, shared_samples, "varlen")
    # one graph per layer call: a graph break would add frames
    assert frames[0] == 1 and frames[-1] == frames[1], frames


def _compiled_frames_over_rows(model, samples, backend):
    """Forward+backward rows of 3, 5, 7 and 8 samples through compiled layers (checked against
    the dense mask); the compiled frame count after each."""
    enable_tree_attention(model)
    compiled = copy.deepcopy(model)
    counter = CompileCounter()
    compile_decoder_layers(compiled, backend=counter)
    frames = []
    for k in (3, 5, 7, 8):
        row = pack_row(samples[:k])
        ref = forward_row(model, row, temperature=1.0, backend="sdpa").token.logprobs
        got = forward_row(compiled, row, temperature=1.0, backend=backend).token.logprobs
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        got.sum().backward()
        frames.append(counter.frame_count)
    return frames


def test_level_tree_attention_in_the_layer_graph_reuses_it(
    tiny_qwen3, shared_samples, fresh_dynamo
):
    """The level split is one custom op inside the compiled layer (no graph break), the rows
    still equal the dense mask, and rows of new lengths reuse the graphs."""
    frames = _compiled_frames_over_rows(tiny_qwen3, shared_samples, "levels")
    assert frames[0] == 1 and frames[-1] == frames[1], frames
