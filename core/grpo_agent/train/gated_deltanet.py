"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.6, Qwen3-Next) in tree-packed rows.

Design decision: a Gated DeltaNet layer mixes tokens in exactly two places, its causal short
convolution and its chunked gated delta rule; the projections, gates and norms around them are
per token. So we keep the model's own layer code and replace only those two functions of its
modeling module with dispatchers: with a packed row's `tree_mask` in the forward kwargs (the
decoder passes them down) they run the tree versions, otherwise the originals. In the tree
- the convolution of a token reads its predecessors along its own trie path (a segment shorter
  than the kernel reaches into its grandparents);
- the delta rule runs each segment from its parent segment's final state (siblings share it;
  roots start from zero): the torch kernel does the within-chunk work of every segment of the
  row in one batch and steps the state chunk by chunk along the trie (all chunks at the same
  distance from their root at once); flash-linear-attention, where it runs, goes depth by depth
  with per-segment initial states. Forward and backward are those of each sample run alone.
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
    """One row's structure for the linear layers, as index tensors on the model's device.

    Built once per row (`forward.forward_hidden`) and shared by every linear layer."""

    # path convolution: the tokens fewer than K-1 tokens into their segment, and their taps
    fix_rows: torch.Tensor  # [M] long
    fix_taps: torch.Tensor  # [M*K] long: token read by each tap, oldest first
    fix_valid: torch.Tensor  # [M*K, 1] float: 0 where the tap has no token (reads zero)
    # torch delta rule: segments cut into chunks, chunks ordered by step along the trie
    slots: torch.Tensor  # [N] long: each token's row in the [num_chunks * chunk] layout
    num_chunks: int
    step_sizes: list[int]  # chunks per step
    step_preds: list[torch.Tensor | None]  # per step: predecessor in the previous step
    chunk: int
    kernel: str  # "fla" or "torch"
    fla: dict | None = None  # depth-by-depth index tensors for flash-linear-attention
    calls: dict[str, int] = field(default_factory=lambda: {"conv": 0, "rule": 0})

    @classmethod
    def build(cls, row: PackedRow, device, conv_kernel: int,
              chunk: int | None = None) -> DeltaPlan:
        device = torch.device(device)
        chunk = chunk or delta_rule.chunk_size(device)
        n = row.num_tokens
        _, counts = torch.unique_consecutive(row.segment_ids, return_counts=True)
        lens = counts.tolist()
        ends = counts.cumsum(0).tolist()
        starts = [e - ln for e, ln in zip(ends, lens)]
        rows, taps, valid = [], [], []
        for s, path in enumerate(row.segment_paths):
            own = len(path) - lens[s]
            for p in range(own, min(own + conv_kernel - 1, len(path))):
                rows.append(path[p])
                for j in range(conv_kernel - 1, -1, -1):
                    taps.append(path[p - j] if p >= j else 0)
                    valid.append(1.0 if p >= j else 0.0)
        depth = (row.segment_ancestors.sum(1) - 1).tolist()
        parent = _parents(row.segment_ancestors, depth)
        # chunks: segment s (layout order: parents before children) starts at the step after
        # its parent's last chunk; chunk i of s is at step first[s] + i
        n_chunks = [-(-ln // chunk) for ln in lens]
        first = [0] * len(lens)
        for s in sorted(range(len(lens)), key=depth.__getitem__):
            first[s] = first[parent[s]] + n_chunks[parent[s]] if parent[s] >= 0 else 0
        by_step: list[list[tuple[int, int]]] = [
            [] for _ in range(max(f + c for f, c in zip(first, n_chunks)))]
        for s in range(len(lens)):
            for i in range(n_chunks[s]):
                by_step[first[s] + i].append((s, i))
        index = {sc: i for step in by_step for i, sc in enumerate(step)}
        preds: list[torch.Tensor | None] = [None]
        order = [sc for step in by_step for sc in step]
        for t in range(1, len(by_step)):
            pred = [index[(s, i - 1)] if i else index[(parent[s], n_chunks[parent[s]] - 1)]
                    for s, i in by_step[t]]
            same = len(pred) == len(by_step[t - 1]) and pred == list(range(len(pred)))
            preds.append(None if same else torch.tensor(pred))
        global_index = {sc: g for g, sc in enumerate(order)}
        table = torch.zeros(len(lens), max(n_chunks), dtype=torch.long)
        for (s, i), g in global_index.items():
            table[s, i] = g
        seg = row.segment_ids.long()
        pos = torch.arange(n) - torch.tensor(starts)[seg]
        slots = table[seg, pos // chunk] * chunk + pos % chunk
        kernel = "fla" if device.type == "cuda" and delta_rule.fla_chunk_rule() else "torch"
        fla = _fla_plan(device, lens, starts, ends, depth, parent) if kernel == "fla" else None
        moved = to_device(device, torch.tensor(rows, dtype=torch.long),
                          torch.tensor(taps, dtype=torch.long),
                          torch.tensor(valid).unsqueeze(1), slots, *preds)
        return cls(*moved[:4], len(order), [len(s) for s in by_step], moved[4:], chunk, kernel,
                   fla)

    @property
    def taps(self) -> dict[int, list[int | None]]:
        """Boundary token -> the tokens its taps read (None: no predecessor), for inspection."""
        k = self.fix_taps.numel() // max(1, self.fix_rows.numel())
        taps = self.fix_taps.view(-1, k).tolist()
        valid = self.fix_valid.view(-1, k).tolist()
        return {r: [t if ok else None for t, ok in zip(ts, vs)]
                for r, ts, vs in zip(self.fix_rows.tolist(), taps, valid)}


def _fla_plan(device, lens, starts, ends, depth, parent) -> dict:
    """Per depth: the tokens of its segments, their bounds, each segment's parent slot."""
    by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for s, d in enumerate(depth):
        by_depth[d].append(s)
    slot = {s: i for segs in by_depth for i, s in enumerate(segs)}
    tokens, cus, parents, order = [], [], [], []
    for d, segs in enumerate(by_depth):
        toks = [i for s in segs for i in range(starts[s], ends[s])]
        tokens.append(torch.tensor(toks))
        cus.append(F.pad(torch.tensor([lens[s] for s in segs]).cumsum(0), (1, 0)))
        parents.append(torch.tensor([slot[parent[s]] for s in segs]) if d else None)
        order.extend(toks)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return {"tokens": to_device(device, *tokens), "cu": to_device(device, *cus), "cu_cpu": cus,
            "parents": to_device(device, *parents), "inverse": to_device(device, inverse)[0]}


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
    out = delta_rule.path_conv(hidden_states[0], weight, bias, plan.fix_rows, plan.fix_taps,
                               plan.fix_valid)
    if activation is not None:
        out = F.silu(out) if activation in ("silu", "swish") else _activation(activation)(out)
    return out.to(hidden_states.dtype)[None]


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@torch.compiler.disable
def tree_delta_rule(plan: DeltaPlan, query, key, value, g, beta, use_qk_l2norm_in_kernel=False):
    """The model's chunked delta rule ([1, N, H, D] in, ([1, N, H, Dv], None) out), each
    segment from its parent segment's final state."""
    plan.calls["rule"] += 1
    q, k, v, g, beta = (x[0] for x in (query, key, value, g, beta))
    fla = delta_rule.fla_chunk_rule() if plan.kernel == "fla" else None
    delta_rule.announce("flash-linear-attention" if fla else "torch")
    if fla is None:
        out = delta_rule.tree_chunk_delta_rule(
            q, k, v, g, beta, plan.slots, plan.num_chunks, plan.step_sizes, plan.step_preds,
            use_qk_l2norm_in_kernel, plan.chunk)
        return out.to(value.dtype)[None], None
    depths = plan.fla
    outs, finals = [], None
    last = len(depths["tokens"]) - 1
    for d, tokens in enumerate(depths["tokens"]):
        parts = [x.index_select(0, tokens)[None] for x in (q, k, v, g, beta)]
        parents = depths["parents"][d]
        h0 = finals.index_select(0, parents) if finals is not None else None
        out, finals = fla(*parts, scale=q.shape[-1] ** -0.5, initial_state=h0,
                          output_final_state=d < last,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          cu_seqlens=depths["cu"][d], cu_seqlens_cpu=depths["cu_cpu"][d])
        outs.append(out[0])
    out = torch.cat(outs).index_select(0, depths["inverse"])
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
