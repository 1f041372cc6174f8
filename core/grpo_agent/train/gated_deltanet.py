"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.6, Qwen3-Next) in tree-packed rows.

Design decision: a Gated DeltaNet layer mixes tokens in exactly two places, its causal short
convolution and its chunked gated delta rule; the projections, gates and norms around them are
per token. So we keep the model's own layer code and replace only those two functions of its
modeling module with dispatchers: with a packed row's `tree_mask` in the forward kwargs (the
decoder passes them down) they run the tree versions, otherwise the originals. In the tree
- the convolution of a token reads its predecessors along its own trie path (a segment shorter
  than the kernel reaches into its grandparents);
- the delta rule walks the trie depth by depth, all segments of a depth in one varlen call,
  each starting from its parent segment's final state (siblings share it; roots start from
  zero), so forward and backward are those of each sample run alone.
`forward.forward_hidden` builds the row's `DeltaPlan` and checks afterwards that every linear
layer took the tree path, so a transformers version that stops passing the kwargs fails loudly
instead of letting the state run across segments. Kernels: `delta_rule`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grpo_agent.train import delta_rule
from grpo_agent.train.packing import PackedRow
from grpo_agent.train.transfer import to_device

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Token mixers whose modeling module calls `causal_conv1d_fn` and `torch_chunk_gated_delta_rule`
# with the decoder's kwargs (transformers 5.x: Qwen3.5, Qwen3.5-MoE = Qwen3.6, Qwen3-Next).
SUPPORTED_MIXERS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
_PATCHED = "_grpo_tree_original"


@dataclass
class DeltaPlan:
    """One row's structure for the linear layers, as index tensors on the model's device."""

    taps: torch.Tensor  # [N, K] long: token read by each conv tap (N = none), oldest first
    depth_tokens: list[torch.Tensor]  # per depth: the rows of its segments, segment by segment
    depth_cu: list[torch.Tensor]  # per depth: int32/long segment bounds in depth_tokens
    depth_cu_cpu: list[torch.Tensor]
    depth_parents: list[torch.Tensor | None]  # per depth: parent's index in the previous depth
    pad_index: list[torch.Tensor]  # per depth: [B*L] into depth_tokens (torch kernel)
    unpad_index: list[torch.Tensor]  # per depth: [T_d] rows of the padded output
    pad_shape: list[tuple[int, int]]  # per depth: (segments B, padded length L)
    inverse: torch.Tensor  # [N]: row of each token in the depths' outputs concatenated
    kernel: str  # "fla" or "torch"
    calls: dict[str, int] = field(default_factory=lambda: {"conv": 0, "rule": 0})

    @classmethod
    def build(cls, row: PackedRow, device, conv_kernel: int) -> DeltaPlan:
        device = torch.device(device)
        n, seg_ids = row.num_tokens, row.segment_ids.tolist()
        _, counts = torch.unique_consecutive(row.segment_ids, return_counts=True)
        lens = counts.tolist()
        ends = counts.cumsum(0).tolist()
        starts = [e - ln for e, ln in zip(ends, lens)]
        taps = []  # rows in token order: segments are contiguous and numbered in layout order
        for path in row.segment_paths:
            own = len(path) - lens[seg_ids[path[-1]]]
            for p in range(own, len(path)):
                taps.append([path[p - j] if p >= j else n for j in range(conv_kernel - 1, -1, -1)])
        depth = (row.segment_ancestors.sum(1) - 1).tolist()
        by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
        for s, d in enumerate(depth):
            by_depth[d].append(s)
        slot = {s: i for segs in by_depth for i, s in enumerate(segs)}
        parent = _parents(row.segment_ancestors, depth)
        host: dict[str, list] = {k: [] for k in ("tokens", "cu", "parents", "pad", "unpad")}
        shapes, order = [], []
        for d, segs in enumerate(by_depth):
            tokens = [i for s in segs for i in range(starts[s], ends[s])]
            seg_lens = [lens[s] for s in segs]
            cu = F.pad(torch.tensor(seg_lens).cumsum(0), (1, 0))
            longest = -(-max(seg_lens) // delta_rule.CHUNK) * delta_rule.CHUNK
            pad = torch.full((len(segs), longest), len(tokens))  # len(tokens): a zero row
            for b, (lo, ln) in enumerate(zip(cu.tolist(), seg_lens)):
                pad[b, :ln] = torch.arange(lo, lo + ln)
            host["tokens"].append(torch.tensor(tokens))
            host["cu"].append(cu)
            host["parents"].append(torch.tensor([slot[parent[s]] for s in segs]) if d else None)
            host["pad"].append(pad.flatten())
            host["unpad"].append(
                torch.cat([torch.arange(ln) + b * longest for b, ln in enumerate(seg_lens)]))
            shapes.append((len(segs), longest))
            order.extend(tokens)
        inverse = torch.empty(n, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(n)
        moved = {k: to_device(device, *v) for k, v in host.items()}
        kernel = "fla" if device.type == "cuda" and delta_rule.fla_chunk_rule() else "torch"
        taps_d, inverse_d = to_device(device, torch.tensor(taps), inverse)
        return cls(taps_d, moved["tokens"], moved["cu"], host["cu"], moved["parents"],
                   moved["pad"], moved["unpad"], shapes, inverse_d, kernel)


def _parents(ancestors: torch.Tensor, depth: list[int]) -> list[int]:
    """Each segment's parent: its ancestor one depth up (-1 for roots)."""
    out = []
    for s, d in enumerate(depth):
        ups = [a for a in ancestors[s].nonzero().flatten().tolist() if depth[a] == d - 1]
        out.append(ups[0] if ups else -1)
    return out


@torch.compiler.disable
def tree_conv(plan: DeltaPlan, hidden_states, weight, bias=None, activation=None):
    """The model's `causal_conv1d_fn` contract ([1, C, N] in and out) along trie paths."""
    plan.calls["conv"] += 1
    out = delta_rule.path_conv(hidden_states[0].transpose(0, 1), weight, bias, plan.taps)
    if activation is not None:
        out = F.silu(out) if activation in ("silu", "swish") else _activation(activation)(out)
    return out.to(hidden_states.dtype).transpose(0, 1)[None]


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@torch.compiler.disable
def tree_delta_rule(plan: DeltaPlan, query, key, value, g, beta, use_qk_l2norm_in_kernel=False):
    """The model's chunked delta rule ([1, N, H, D] in, ([1, N, H, Dv], None) out), depth by
    depth from each segment's parent state."""
    plan.calls["rule"] += 1
    q, k, v, g, beta = (x[0] for x in (query, key, value, g, beta))
    scale = q.shape[-1] ** -0.5
    fla = delta_rule.fla_chunk_rule() if plan.kernel == "fla" else None
    delta_rule.announce("flash-linear-attention" if fla else "torch")
    if fla is None:
        q, k = q.float(), k.float()
        if use_qk_l2norm_in_kernel:
            q, k = delta_rule.l2norm(q), delta_rule.l2norm(k)
        q = q * scale
    outs, finals = [], None
    last = len(plan.depth_tokens) - 1
    for d, tokens in enumerate(plan.depth_tokens):
        parts = [x.index_select(0, tokens) for x in (q, k, v, g, beta)]
        parents = plan.depth_parents[d]
        h0 = finals.index_select(0, parents) if finals is not None else None
        if fla is not None:
            out, finals = fla(*(x[None] for x in parts), scale=scale, initial_state=h0,
                              output_final_state=d < last, use_qk_l2norm_in_kernel=
                              use_qk_l2norm_in_kernel, cu_seqlens=plan.depth_cu[d],
                              cu_seqlens_cpu=plan.depth_cu_cpu[d])
            out = out[0]
        else:
            batch, length = plan.pad_shape[d]
            out, finals = delta_rule.torch_chunk_delta_rule(
                *parts, h0, plan.pad_index[d], batch, length, d < last)
            out = out.index_select(0, plan.unpad_index[d])
        outs.append(out)
    out = torch.cat(outs).index_select(0, plan.inverse)
    return out.to(value.dtype)[None], None


def _conv_dispatcher(original):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        tree = kwargs.get("tree_mask")
        if tree is None or getattr(tree, "linear", None) is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return tree_conv(tree.linear, hidden_states, weight, bias, activation)

    setattr(causal_conv1d_fn, _PATCHED, original)
    return causal_conv1d_fn


def _rule_dispatcher(original):
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, **kwargs):
        tree = kwargs.get("tree_mask")
        if tree is None or getattr(tree, "linear", None) is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if kwargs.get("initial_state") is not None:
            raise ValueError("tree-packed rows run without a cache: got an initial state.")
        return tree_delta_rule(tree.linear, query, key, value, g, beta,
                               kwargs.get("use_qk_l2norm_in_kernel", False))

    setattr(torch_chunk_gated_delta_rule, _PATCHED, original)
    return torch_chunk_gated_delta_rule


def text_config(config):
    """The language model's config: the text config of a composite (image-text-to-text) one."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter else config


def linear_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet modules; refuses any other non-attention layer type."""
    layer_types = getattr(text_config(model.config), "layer_types", None) or []
    other = sorted(set(layer_types) - ATTENTION_LAYER_TYPES)
    if not other:
        return []
    mixers = [m for m in model.modules() if type(m).__name__ in SUPPORTED_MIXERS]
    expected = sum(t not in ATTENTION_LAYER_TYPES for t in layer_types)
    if other != ["linear_attention"] or len(mixers) != expected:
        raise NotImplementedError(
            f"{type(model).__name__} has {other} layers ({_mixer_names(model, layer_types)}): "
            "tree packing supports "
            f"attention layers and the Gated DeltaNet layers of {', '.join(SUPPORTED_MIXERS)}; "
            "other recurrent layers (Mamba2, other linear attentions) would run their state "
            "across the packed row's segments. Train it without tree packing."
        )
    return mixers


def _mixer_names(model, layer_types) -> str:
    """Class names of the token mixers of the non-attention layers (e.g. BambaMixer)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    names = set()
    for layer, kind in zip(getattr(decoder, "layers", []), layer_types):
        if kind in ATTENTION_LAYER_TYPES:
            continue
        for child in layer.children():
            name = type(child).__name__
            if not any(w in name.lower() for w in ("norm", "mlp", "moe", "expert", "feedforward")):
                names.add(name)
    return ", ".join(sorted(names)) or "unknown mixer"


def install(model: torch.nn.Module) -> int:
    """Route the model's Gated DeltaNet layers through the tree kernels; returns how many."""
    mixers = linear_mixers(model)
    for module_name in {type(m).__module__ for m in mixers}:
        family = sys.modules[module_name]
        for name, wrap in (("causal_conv1d_fn", _conv_dispatcher),
                           ("torch_chunk_gated_delta_rule", _rule_dispatcher)):
            current = getattr(family, name, None)
            if current is None:
                raise NotImplementedError(f"{module_name} has no {name}: cannot tree-pack it.")
            if not hasattr(current, _PATCHED):
                setattr(family, name, wrap(current))
    model._grpo_linear_layers = len(mixers)
    return len(mixers)


def build_plan(model, row: PackedRow, device) -> DeltaPlan | None:
    """The row's plan when the model has Gated DeltaNet layers (after `install`), else None."""
    if not getattr(model, "_grpo_linear_layers", 0):
        return None
    kernel = text_config(model.config).linear_conv_kernel_dim
    return DeltaPlan.build(row, device, kernel)


def check_calls(model, plan: DeltaPlan | None) -> None:
    """Every Gated DeltaNet layer must have taken the tree path in this forward."""
    if plan is None:
        return
    want = model._grpo_linear_layers
    if plan.calls["conv"] != want or plan.calls["rule"] != want:
        raise RuntimeError(
            f"{want} Gated DeltaNet layers, but the tree path ran {plan.calls}: this transformers "
            "version no longer passes the forward kwargs to causal_conv1d_fn / "
            "torch_chunk_gated_delta_rule, so packed rows would mix samples. Pin transformers "
            "or train without tree packing."
        )
