"""The pre-grad pass that runs linears sharing an input as one matmul: same outputs and
gradients as the separate linears, on a toy module (biases) and on the tiny Qwen3's layers
(q/k/v and gate/up fused: 7 linears per layer become 4; the MLP's gate as `swiglu`'s op where
its devices list the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_agent.train import fused_projections, swiglu
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.regional_compile import compile_decoder_layers
from grpo_agent.train.tree_attention import enable_tree_attention
from torch import nn


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class FusingBackend:
    """A dynamo backend that applies the pass (the linears' part alone, or all of it, as
    inductor does) and runs the rewritten graph eagerly."""

    def __init__(self, whole_pass: bool = False):
        self.whole_pass = whole_pass
        self.linears: list[int] = []  # linear calls per compiled graph, after the pass
        self.swiglus: list[int] = []  # swiglu ops per compiled graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self.whole_pass:
            fused_projections.FUSE_PASS(gm.graph)
        else:
            fused_projections.fuse_shared_input_linears(gm.graph)
        gm.recompile()
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        self.linears.append(sum(t in fused_projections.LINEARS for t in targets))
        self.swiglus.append(targets.count(torch.ops.grpo_agent.swiglu.default))
        return gm.forward


class ThreeHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 5), nn.Linear(8, 3)  # same input, biases: fused
        self.c = nn.Linear(8, 4, bias=False)  # same input, no bias: a group of one
        self.d = nn.Linear(5, 2, bias=False)  # another input

    def forward(self, x):
        return torch.cat([self.d(self.a(x)), self.b(x).relu(), self.c(x)], dim=-1)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_linears_on_one_input_become_one(fresh_dynamo):
    torch.manual_seed(0)
    eager = ThreeHeads()
    model, backend = copy.deepcopy(eager), FusingBackend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 7, 8)
    got, ref = compiled(x), eager(x)
    assert backend.linears == [3]  # a+b fused, c alone, d alone
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    w = torch.randn_like(ref)
    (got * w).sum().backward(), (ref * w).sum().backward()
    for name, grad in _grads(eager).items():
        torch.testing.assert_close(_grads(model)[name], grad, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("swiglu_devices", [("cuda",), ("cpu",)])
def test_decoder_layers_fuse_qkv_and_gate_up(tiny_qwen3, shared_samples, fresh_dynamo,
                                             monkeypatch, swiglu_devices):
    # levels is the one tree path CPU layers run whole (no graph break): one custom op
    monkeypatch.setattr(swiglu, "REWRITE_DEVICES", swiglu_devices)
    enable_tree_attention(tiny_qwen3)
    compiled, backend = copy.deepcopy(tiny_qwen3), FusingBackend(whole_pass=True)
    compile_decoder_layers(compiled, backend=backend)
    row = pack_row(shared_samples)
    results = []
    for model in (tiny_qwen3, compiled):
        logprobs = forward_row(model, row, temperature=1.0, backend="levels").token.logprobs
        logprobs.sum().backward()
        results.append((logprobs.detach(), _grads(model)))
    assert backend.linears == [4]  # qkv, o, gate+up, down: one graph for both layers
    assert backend.swiglus == [1 if "cpu" in swiglu_devices else 0]
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)


def test_install_keeps_a_pass_the_user_set():
    import torch._inductor.config as inductor_config

    def mine(graph):
        pass

    with inductor_config.patch(pre_grad_custom_pass=mine):
        fused_projections.install()
        assert inductor_config.pre_grad_custom_pass is mine
    with inductor_config.patch(pre_grad_custom_pass=None):
        fused_projections.install()
        fused_projections.install()
        assert inductor_config.pre_grad_custom_pass is fused_projections.FUSE_PASS


def _two_linears(weight_dtypes=(torch.float32, torch.float32), mutate=False) -> torch.fx.Graph:
    """x -> linear(x, w1), linear(x, w2) as dynamo hands them over (example values in meta),
    the first output optionally changed in place."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.randn(3, 8)
    weights = [graph.placeholder(f"w{i}") for i in range(len(weight_dtypes))]
    for w, dtype in zip(weights, weight_dtypes):
        w.meta["example_value"] = torch.randn(4, 8, dtype=dtype)
    outputs = [graph.call_function(torch._C._nn.linear, (x, w)) for w in weights]
    if mutate:
        outputs[0] = graph.call_method("add_", (outputs[0], 1.0))
    graph.output(tuple(outputs))
    return graph


@pytest.mark.parametrize("case", ["fused", "dtypes differ", "output changed in place"])
def test_linears_fuse_only_with_one_dtype_and_no_in_place_user(case):
    graph = _two_linears(
        weight_dtypes=(torch.float32, torch.bfloat16) if case == "dtypes differ" else
        (torch.float32, torch.float32), mutate=case == "output changed in place")
    fused_projections.fuse_shared_input_linears(graph)
    linears = [n for n in graph.nodes if n.target in fused_projections.LINEARS]
    assert len(linears) == (1 if case == "fused" else 2)
