"""One matmul for the linear layers that read the same input (q/k/v, gate/up) in compiled layers.

Design decision: a decoder layer's q, k and v projections (and its MLP's gate and up
projections) all multiply the same activations. Run separately they are 5 forward and 10
backward GEMMs per layer, and the packed step on an H200 is bound by the host queueing
kernels (docs/performance.md), so each launch costs time. This pre-grad graph pass, applied
while `torch_compile=True` compiles the decoder layers, rewrites every group of bias-alike
linears on one input into one linear over their concatenated weights followed by a split:
2 forward and 4 backward GEMMs. It rewrites the traced graph only, so the model's modules,
parameter names, checkpoints, weight sync and LoRA adapters do not change; autograd through
the concatenation hands each weight its own slice of the gradient. The cost is a copy of the
weights per forward (about 20 MB per layer for Qwen3-0.6B, well under a millisecond on a GPU).
The same pass then puts `swiglu`'s op where the MLP gates the fused output's two halves.
"""

from __future__ import annotations

import hashlib
import operator
from collections import defaultdict

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from grpo_agent.train import swiglu

LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
ENABLED = True  # set False before compiling to keep the linears apart (benchmarks compare)
fused_groups = 0  # groups rewritten so far in this process


def fuse_shared_input_linears(graph: fx.Graph) -> None:
    """Rewrite each group of >= 2 linears on the same input (in place)."""
    global fused_groups
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in LINEARS and not node.kwargs:
            x, _, bias = (list(node.args) + [None])[:3]
            groups[(x, bias is None)].append(node)
    for nodes in groups.values():
        if len(nodes) >= 2 and _fusable(nodes, order):
            _fuse(graph, sorted(nodes, key=order.__getitem__))
            fused_groups += 1


def _weights_and_biases(nodes: list[fx.Node]) -> tuple[list, list]:
    weights = [n.args[1] for n in nodes]
    biases = [n.args[2] for n in nodes if len(n.args) > 2 and n.args[2] is not None]
    return weights, biases


def _fusable(nodes: list[fx.Node], order: dict[fx.Node, int]) -> bool:
    first = min(order[n] for n in nodes)
    weights, biases = _weights_and_biases(nodes)
    metas = [_meta(w) for w in weights + biases]
    return (
        all(isinstance(p, fx.Node) and order.get(p, first) < first for p in weights + biases)
        and all(m is not None for m in metas)
        and len({m.dtype for m in metas}) == 1
        and len({_meta(w).shape[1:] for w in weights}) == 1
        and not any(_mutates(user) for n in nodes for user in n.users)
    )


def _fuse(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    x = nodes[0].args[0]
    weights, biases = _weights_and_biases(nodes)
    sizes = [_meta(w).shape[0] for w in weights]
    with graph.inserting_before(nodes[0]):
        args = [x, _cat(graph, weights)]
        if biases:
            args.append(_cat(graph, biases))
        fused = graph.call_function(torch._C._nn.linear, tuple(args))
        fused.meta["example_value"] = torch._C._nn.linear(*(_meta(a) for a in args))
        parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
        parts.meta["example_value"] = torch.split(fused.meta["example_value"], sizes, dim=-1)
        outputs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(nodes))]
    for i, (node, part) in enumerate(zip(nodes, outputs)):  # erased after the inserts before it
        part.meta["example_value"] = parts.meta["example_value"][i]
        node.replace_all_uses_with(part)
        graph.erase_node(node)


def _cat(graph: fx.Graph, tensors: list[fx.Node]) -> fx.Node:
    node = graph.call_function(torch.cat, (tensors,), {"dim": 0})
    node.meta["example_value"] = torch.cat([_meta(t) for t in tensors], dim=0)
    return node


def _meta(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _mutates(node: fx.Node) -> bool:
    """An in-place op on a linear's output (it would write into a view of the fused output)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


class _FusePass(CustomGraphPass):
    """The pass as inductor wants it: with a uuid, so compiled graphs stay cacheable."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_shared_input_linears(graph)
        swiglu.rewrite_gated_silu(graph)

    def uuid(self) -> bytes:
        files = get_hash_for_files((__file__, swiglu.__file__))
        return hashlib.sha256(files + repr(swiglu.REWRITE_DEVICES).encode()).digest()


FUSE_PASS = _FusePass()


def install() -> None:
    """Make the pass inductor's pre-grad custom pass (idempotent). Another pass already set
    there is kept and this one is not installed (inductor takes only one on some versions)."""
    import torch._inductor.config as inductor_config

    if ENABLED and inductor_config.pre_grad_custom_pass is None:
        inductor_config.pre_grad_custom_pass = FUSE_PASS
