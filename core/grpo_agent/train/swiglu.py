"""SwiGLU, silu(gate) * up, as one op over the fused gate/up projection's output.

Design decision: once `fused_projections` runs gate and up as one matmul, the MLP computes
silu(gate) * up on the two halves of its output, and autograd's gradient of that split is a
concatenation. Inductor lowers the concatenation as one point-wise kernel over the [tokens x
2 * width] gradient whose every element loads the gradient, gate and up values of its column,
so each is read twice: on an H100 that kernel ran at 0.64 of memory bandwidth, 0.45 ms per
1.7B layer at 16k tokens (docs/performance.md). Here each program reads its columns of gate
and up once and writes both gradient halves. The compiled layer's pre-grad pass
(`fused_projections`) puts this op where the pattern silu(split[0]) * split[1] stands, on
the devices in `REWRITE_DEVICES` (CUDA: on CPU inductor's own fused loop is faster than
the op's torch math).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx
from torch.nn import functional as F

REWRITE_DEVICES = ("cuda",)
BLOCK = 1024  # columns per program: 8 bf16 per thread in 4 warps


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :w]) * gate_up[..., w:] for w = half the last dimension."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension (gate, up); got {gate_up.shape}")
    return _swiglu(gate_up)


@torch.library.custom_op("grpo_agent::swiglu", mutates_args=())
def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if _triton_runs(gate_up):
        return _triton_forward(gate_up.contiguous())
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@_swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("grpo_agent::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    if _triton_runs(gate_up):
        return _triton_backward(grad.contiguous(), gate_up.contiguous())
    gate, up = gate_up.float().chunk(2, dim=-1)
    grad = grad.float()
    sig = torch.sigmoid(gate)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))
    return torch.cat([d_gate, grad * gate * sig], dim=-1).to(gate_up.dtype)


@_swiglu_backward.register_fake
def _(grad, gate_up):
    return gate_up.new_empty(gate_up.shape)


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_backward(grad, gate_up)


_swiglu.register_autograd(_backward, setup_context=_save)


# Triton -------------------------------------------------------------------------------------


def _triton_runs(t: torch.Tensor) -> bool:
    return t.is_cuda and t.numel() > 0 and _kernels() is not None


@functools.cache
def _kernels():
    """(triton, kernels module), or None where Triton does not import (the torch math runs)."""
    try:
        import triton

        from grpo_agent.train import swiglu_kernels
    except Exception:  # noqa: BLE001 -- absent or broken Triton: the torch path is exact
        return None
    return triton, swiglu_kernels


def _grid(triton, gate_up: torch.Tensor) -> tuple[int, int]:
    width = gate_up.shape[-1] // 2
    return gate_up.numel() // gate_up.shape[-1], triton.cdiv(width, BLOCK)


def _triton_forward(gate_up: torch.Tensor) -> torch.Tensor:
    triton, kernels = _kernels()
    width = gate_up.shape[-1] // 2
    h = gate_up.new_empty((*gate_up.shape[:-1], width))
    kernels.forward_kernel[_grid(triton, gate_up)](
        gate_up, h, width, gate_up.shape[-1], width, BLOCK=BLOCK, num_warps=4)
    return h


def _triton_backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    triton, kernels = _kernels()
    width = gate_up.shape[-1] // 2
    d_gate_up = torch.empty_like(gate_up)
    kernels.backward_kernel[_grid(triton, gate_up)](
        grad, gate_up, d_gate_up, width, width, gate_up.shape[-1], gate_up.shape[-1],
        BLOCK=BLOCK, num_warps=4)
    return d_gate_up


# The compiled layer's rewrite ---------------------------------------------------------------

# the pre-grad graph holds torch-level calls (dynamo's), not aten ops
_SILU = (F.silu,)
_MUL = (operator.mul, torch.mul)


def rewrite_gated_silu(graph: fx.Graph) -> int:
    """Replace each silu(parts[0]) * parts[1], where parts = torch.split(x, [w, w], dim=-1),
    by swiglu(x) (in place), for x on a device in `REWRITE_DEVICES`; returns how many."""
    rewritten = 0
    for node in list(graph.nodes):
        x = _gated_silu_input(node)
        if x is None:
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.grpo_agent.swiglu.default, (x,))
        fused.meta["example_value"] = torch.ops.grpo_agent.swiglu.default(
            x.meta["example_value"])
        node.replace_all_uses_with(fused)
        graph.erase_node(node)  # the silu and the split's parts are left to inductor to drop
        rewritten += 1
    return rewritten


def _gated_silu_input(node: fx.Node) -> fx.Node | None:
    """x when `node` is silu(split(x)[0]) * split(x)[1] as described above, else None."""
    if node.op != "call_function" or node.target not in _MUL or len(node.args) != 2:
        return None
    act, up = node.args
    if not (isinstance(act, fx.Node) and act.target in _SILU and not act.kwargs.get("inplace")):
        return None
    gate = act.args[0]
    halves = [_split_part(gate), _split_part(up)]
    if None in halves or halves[0][0] is not halves[1][0] or [h[1] for h in halves] != [0, 1]:
        return None
    split = halves[0][0]
    x = split.args[0]
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size_or_sections")
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    if (not isinstance(value, torch.Tensor) or value.device.type not in REWRITE_DEVICES
            or dim not in (-1, value.dim() - 1) or not isinstance(sizes, (list, tuple))
            or len(sizes) != 2 or sizes[0] != sizes[1]):
        return None
    return x


def _split_part(node) -> tuple[fx.Node, int] | None:
    """(split node, index) when `node` is getitem(torch.split(...), index)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is operator.getitem):
        return None
    split, index = node.args
    if not (isinstance(split, fx.Node) and split.op == "call_function"
            and split.target is torch.split):
        return None
    return split, index
