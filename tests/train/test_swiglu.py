"""`swiglu`: the op equals silu(gate) * up with autograd's gradients; the compiled layer's
pre-grad pass puts it only where the pattern is exact (the tiny Qwen3's layers with it:
tests/train/test_fused_projections.py); on CUDA its Triton kernels equal the float32 math."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from grpo_agent.train import fused_projections, swiglu
from torch import nn
from torch.nn import functional as F

SWIGLU = torch.ops.grpo_agent.swiglu.default


def _reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("shape", [(5, 14), (2, 3, 8)])
def test_op_equals_the_math_and_its_gradient(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    got_x, ref_x = x.float().requires_grad_(), x.clone().requires_grad_()
    got, ref = swiglu.swiglu(got_x), _reference(ref_x)
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-6)
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (got * w.float()).sum().backward(), (ref * w).sum().backward()
    torch.testing.assert_close(got_x.grad.double(), ref_x.grad, atol=1e-5, rtol=1e-5)


def test_op_passes_opcheck_and_refuses_odd_widths():
    x = torch.randn(4, 10, requires_grad=True)
    torch.library.opcheck(swiglu._swiglu, (x,))
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu.swiglu(torch.randn(3, 7))


class RewritingBackend:
    """A dynamo backend that applies the inductor pass and runs the rewritten graph eagerly."""

    def __init__(self):
        self.counts: list[tuple[int, int]] = []  # (swiglu ops, silu calls) per graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        fused_projections.FUSE_PASS(gm.graph)
        gm.recompile()
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        self.counts.append((targets.count(SWIGLU),
                            sum(t in swiglu._SILU for t in targets)))
        return gm.forward


@pytest.fixture
def on_cpu(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(swiglu, "REWRITE_DEVICES", ("cpu",))
    yield
    torch._dynamo.reset()


class Gated(nn.Module):
    """One fused projection split in two, gated the way `variant` says."""

    def __init__(self, variant: str):
        super().__init__()
        self.proj, self.variant = nn.Linear(6, 8), variant

    def forward(self, x):
        y = self.proj(x)
        if self.variant == "three":  # the halves of a three-way split: not gate/up
            gate, up, _ = torch.split(y, [2, 2, 4], dim=-1)
        elif self.variant == "unequal":  # broadcasts: one gate column over seven
            gate, up = torch.split(y, [1, 7], dim=-1)
        elif self.variant == "rows":  # split over tokens, not features
            gate, up = torch.split(y, [2, 2], dim=0)
        else:
            gate, up = torch.split(y, [4, 4], dim=-1)
        if self.variant == "swapped":
            return F.silu(up) * gate
        if self.variant == "relu":
            return F.relu(gate) * up
        return F.silu(gate) * up


@pytest.mark.parametrize("variant,ops", [("plain", 1), ("swapped", 0), ("three", 0),
                                         ("unequal", 0), ("rows", 0), ("relu", 0)])
def test_only_the_exact_pattern_is_rewritten(variant, ops, on_cpu):
    torch.manual_seed(0)
    eager = Gated(variant)
    backend = RewritingBackend()
    compiled = torch.compile(copy.deepcopy(eager), backend=backend)
    x = torch.randn(4, 6)
    torch.testing.assert_close(compiled(x), eager(x), atol=1e-6, rtol=1e-6)
    assert [c[0] for c in backend.counts] == [ops]


def test_no_rewrite_off_the_listed_devices(fresh_cpu_only):
    backend = RewritingBackend()
    torch.compile(Gated("plain"), backend=backend)(torch.randn(3, 6))
    assert backend.counts == [(0, 1)]


@pytest.fixture
def fresh_cpu_only():
    torch._dynamo.reset()
    assert swiglu.REWRITE_DEVICES == ("cuda",)
    yield
    torch._dynamo.reset()


def test_pass_uuid_follows_the_devices(monkeypatch):
    before = fused_projections.FUSE_PASS.uuid()
    monkeypatch.setattr(swiglu, "REWRITE_DEVICES", ("cpu",))
    assert fused_projections.FUSE_PASS.uuid() != before


def test_getitem_of_something_else_is_left_alone():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    parts = graph.call_function(torch.chunk, (x, 2), {"dim": -1})
    gate = graph.call_function(operator.getitem, (parts, 0))
    up = graph.call_function(operator.getitem, (parts, 1))
    graph.output(graph.call_function(operator.mul, (graph.call_function(F.silu, (gate,)), up)))
    assert swiglu.rewrite_gated_silu(graph) == 0


# CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 2 * 1500), (2, 5, 2 * 3072)])
def test_triton_kernels_equal_the_float32_math(dtype, shape):
    assert swiglu._kernels() is not None
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dtype)
    ref_x = x.float().clone().requires_grad_()
    got_x = x.clone().requires_grad_()
    got = swiglu.swiglu(got_x)
    ref = _reference(ref_x)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, ref.to(dtype), **tol)
    w = torch.randn(ref.shape, device="cuda", generator=gen).to(dtype)
    (got.float() * w.float()).sum().backward()
    (ref * w.float()).sum().backward()
    torch.testing.assert_close(got_x.grad, ref_x.grad.to(dtype), **tol)
