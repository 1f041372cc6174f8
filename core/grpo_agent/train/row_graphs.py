"""CUDA graphs over bucketed row shapes: one graph launch per packed row, not ~2,100 kernels.

Design decision: at 8k-token rows the compiled packed step is bound by the host queueing its
kernels (about 40 us of host time each on an H200, docs/performance.md), and inductor's own
CUDA graphs ("reduce-overhead") fail on per-layer compiled blocks. So the whole row step --
decoder, LM head, loss and backward, gradients accumulated in place into the parameters'
`.grad` -- is captured by hand, once per *bucket*: a row is padded up to the bucket's sizes
(tokens, segments, gathered keys, trained tokens, the kernel's max sequence lengths), its
tree metadata is copied into that bucket's static buffers, and the graph is replayed.

Padding is exact for the real tokens: the padding tokens form one extra segment at the end of
the row that sees only padding keys (the varlen plan's last segment), extra segments are empty
(`cu_seqlens` repeated), and padded trained entries carry `valid` 0, so the loss and every
gradient they could carry are zero. Three tree paths can be captured: varlen (the default; the
row always gathers its keys, an unshared row too, so one plan shape serves every row), levels
(`backend="levels"`: the self part's padding segment, and per depth part one padding pair of
padding query and key rows; a bucket also fixes the number of depths) and masked
(`backend="masked"`, FlashAttention 4 with the tree as its mask: the padding tokens' `until`
is the bucket's end, so they are one causal segment; the block lists are built from `until`
inside the graph, so a bucket is its token and trained-entry counts only); `backend="auto"`
takes masked for the rows the eager trainer's `auto` gives it, varlen for the others. Level
graphs were first timed on an H200 on the traced level path whose gradients were wrong
(docs/performance.md); the level split is now one custom op inside the captured step. Off CUDA
nothing is captured and the padded step runs as is: the CPU tests hold it to the unpadded
path. All buckets share one memory pool, captured largest
first (`RowGraphs.prepare`): a step's temporaries are freed at the end of each capture, the
smaller buckets reuse the largest one's blocks, and buckets never replay at the same time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_agent.train import (
    level_attention,
    level_merge,
    masked_attention,
    tree_attention,
    varlen_attention,
)
from grpo_agent.train.forward import attention_head_dim
from grpo_agent.train.logprobs import TokenLogprobs, token_logprobs
from grpo_agent.train.packing import PackedRow
from grpo_agent.train.tree_attention import ATTN_IMPLEMENTATION, TreeMask

# Bucket granularity: each size is rounded up to a multiple of its step. Coarser steps mean
# fewer graphs (captures, static buffers) but more padded work per row; since the buckets
# share the largest one's memory (`RowGraphs.prepare`), fine token steps cost no memory. On
# an H200 (0.6B shape, 8k rows) 64-token steps for tokens and trained entries were 2.6-3.2%
# faster back to back than 512-token steps (docs/performance.md). "rows": a level part's
# selected query and key rows.
STEPS = {"tokens": 64, "segments": 16, "keys": 512, "trained": 64, "seqlen": 256, "rows": 64}
BACKENDS = ("varlen", "levels", "masked")

# loss_fn(token log-probs, the bucket's padded per-trained-token tensors) -> scalar loss.
# The tensors: "valid" (1.0 for real trained tokens, 0.0 for padding), "advantages" (0.0 at
# padding), "sampler_logprobs", and with sampler top-k "sampler_topk_logprobs" (-inf at
# padding). It must give padded entries (valid 0) no weight.
LossFn = Callable[[TokenLogprobs, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class RowStep:
    """One row's step through its graph: views of the bucket's static tensors, overwritten by
    the next replay of any bucket (they share one pool): read or clone them before that."""

    token: TokenLogprobs  # the real trained tokens' log-probs, entropy, top-k log-probs
    loss: torch.Tensor  # 0-d: loss_fn times the step's scale, as backpropagated
    inputs: dict[str, torch.Tensor]  # the bucket's padded inputs (padded_inputs' names)


def _up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class DepthBucket:
    """The static shapes of one depth part of a levels row."""

    queries: int  # selected query rows, the padding pair's included (at least one)
    keys: int  # selected key rows, likewise
    pairs: int  # (descendants, segment) pairs: real + padding pair + empty ones
    max_q: int
    max_k: int

    @classmethod
    def of(cls, pairs: list[tuple[range, range]], pad_tokens: int,
           steps: dict[str, int] | None = None) -> DepthBucket:
        steps = STEPS if steps is None else steps
        q_lens, k_lens = [len(q) for q, _ in pairs], [len(k) for _, k in pairs]
        queries = _up(sum(q_lens) + 1, steps["rows"])
        keys = _up(sum(k_lens) + 1, steps["rows"])
        return cls(
            queries=queries,
            keys=keys,
            pairs=_up(len(pairs) + 1, steps["segments"]),
            max_q=_up(max(*q_lens, queries - sum(q_lens), pad_tokens), steps["seqlen"]),
            max_k=_up(max(*k_lens, keys - sum(k_lens)), steps["seqlen"]),
        )


@dataclass(frozen=True)
class Bucket:
    """The static shapes of one graph."""

    backend: str  # tree attention path: one of BACKENDS
    tokens: int  # row tokens, real + padding (at least one padding token)
    trained: int  # trained-token entries
    segments: int = 0  # varlen, levels: segments, real + padding segment + empty ones
    max_q: int = 0  # varlen, levels: longest segment
    keys: int = 0  # varlen: gathered keys (sum of path lengths), padding segment included
    max_k: int = 0  # varlen: longest path
    depths: tuple[DepthBucket, ...] = ()  # levels: one per depth part
    topk: int = 0  # the sampler's top-k ids per trained token (0: none)

    @classmethod
    def of(cls, row: PackedRow, backend: str = "varlen",
           steps: dict[str, int] | None = None) -> Bucket:
        """`steps`: the granularity of each size (default `STEPS`)."""
        steps = STEPS if steps is None else steps
        if backend not in BACKENDS:
            raise ValueError(f"row graphs backend {backend!r}: choose one of {BACKENDS}")
        tokens = _up(row.num_tokens + 1, steps["tokens"])
        pad = tokens - row.num_tokens
        shapes = {
            "backend": backend,
            "tokens": tokens,
            "trained": _up(max(row.num_trained, 1), steps["trained"]),
            "topk": 0 if row.sampler_topk_ids is None else row.sampler_topk_ids.shape[1],
        }
        if backend == "masked":
            return cls(**shapes)
        own = torch.bincount(row.segment_ids).tolist()
        shapes |= {"segments": _up(len(own) + 1, steps["segments"]),
                   "max_q": _up(max(max(own), pad), steps["seqlen"])}
        if backend == "levels":
            _, depths = level_attention.tree_parts(row)
            return cls(**shapes, depths=tuple(DepthBucket.of(p, pad, steps) for p in depths))
        path_keys = sum(len(p) for p in row.segment_paths)
        keys = _up(path_keys + pad, steps["keys"])
        return cls(**shapes, keys=keys, max_k=_up(
            max(max(len(p) for p in row.segment_paths), keys - path_keys), steps["seqlen"]))


def _cu(lengths: list[int], total: int) -> torch.Tensor:
    """int32 bounds of `lengths`, then empty ranges up to `total` ranges."""
    lens = torch.tensor(lengths + [0] * (total - len(lengths)))
    return F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)


def _cycled(rows: torch.Tensor, n: int) -> torch.Tensor:
    """`n` indices into `rows`, repeating them as needed (padding rows read more than once)."""
    return rows[torch.arange(n) % rows.numel()]


def padded_inputs(row: PackedRow, bucket: Bucket) -> dict[str, torch.Tensor]:
    """The row's tensors padded to `bucket` (CPU). Padding tokens [N, tokens) are one segment
    at the end; every attention range they are in holds padding rows only, so each padding
    query sees padding keys only and no real query sees a padding key. varlen: the padding
    segment's keys are `keys - sum(paths)` padding rows, its own tokens last. levels: the self
    part's padding segment is causal on itself; each depth part ends with a padding pair
    whose queries and keys are padding rows (read more than once where the part's padded
    sizes exceed the padding tokens: such copies compute the same values). masked: `until`
    of a padding key is the bucket's end (seen by the padding queries after it), a real
    key's stops at or before N."""
    n, pad = row.num_tokens, bucket.tokens - row.num_tokens
    pad_rows = torch.arange(n, bucket.tokens)
    t, extra = row.num_trained, bucket.trained - row.num_trained

    def trained(x: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([x, torch.full((extra,), fill, dtype=x.dtype)])

    inputs = {
        "input_ids": torch.cat([row.input_ids, torch.zeros(pad, dtype=row.input_ids.dtype)]),
        "position_ids": torch.cat([row.position_ids, torch.arange(pad)]),
        "pred_index": trained(row.pred_index, n),  # padded entries read the first pad row
        "targets": trained(row.targets, 0),
        "valid": trained(torch.ones(t), 0.0),
        "advantages": trained(row.advantages.float(), 0.0),
        "sampler_logprobs": trained(row.sampler_logprobs.float(), 0.0),
        "scale": torch.zeros(()),  # set by each step (`RowGraphs.step`)
    }
    if bucket.topk:
        k = bucket.topk
        inputs["topk_ids"] = torch.cat([row.sampler_topk_ids, torch.full((extra, k), -1)])
        inputs["sampler_topk_logprobs"] = torch.cat(
            [row.sampler_topk_logprobs.float(), torch.full((extra, k), -torch.inf)])
    if bucket.backend == "masked":
        until = tree_attention.visible_until(row.segment_ids, row.segment_ancestors)
        inputs["until"] = torch.cat([until, torch.full((pad,), bucket.tokens)]).to(torch.int32)
        return inputs
    own = torch.bincount(row.segment_ids).tolist()
    inputs["cu_q"] = _cu(own + [pad], bucket.segments)
    if bucket.backend == "levels":
        _, depths = level_attention.tree_parts(row)
        for d, (pairs, shape) in enumerate(zip(depths, bucket.depths, strict=True)):
            q_rows = [i for q, _ in pairs for i in q]
            k_rows = [i for _, k in pairs for i in k]
            extra_q, extra_k = shape.queries - len(q_rows), shape.keys - len(k_rows)
            inputs[f"depth{d}_q"] = torch.cat([torch.tensor(q_rows), _cycled(pad_rows, extra_q)])
            inputs[f"depth{d}_k"] = torch.cat([torch.tensor(k_rows), _cycled(pad_rows, extra_k)])
            inputs[f"depth{d}_cu_q"] = _cu([len(q) for q, _ in pairs] + [extra_q], shape.pairs)
            inputs[f"depth{d}_cu_k"] = _cu([len(k) for _, k in pairs] + [extra_k], shape.pairs)
        return inputs
    path_lens = [len(p) for p in row.segment_paths]
    pad_keys = bucket.keys - sum(path_lens)
    inputs["cu_k"] = _cu(path_lens + [pad_keys], bucket.segments)
    inputs["kv_index"] = torch.cat([
        torch.tensor([i for p in row.segment_paths for i in p], dtype=torch.long),
        torch.full((pad_keys - pad,), n, dtype=torch.long),  # extra keys: the first pad row
        pad_rows,
    ])
    return inputs


class RowGraphs:
    """Forward+backward of packed rows through one captured graph per bucket.

    `step(row, scale)` accumulates scale * d loss_fn / d params into each parameter's `.grad`
    (as `(scale * loss).backward()` would) and returns the row's `RowStep`: views of the
    bucket's static outputs, overwritten by the next replay of any bucket (they share one
    pool; clone to keep). `prepare(rows)` makes the graphs of a step's rows up front.
    The graphs accumulate into fixed gradient tensors: `zero_grad(set_to_none=True)` is
    fine (they are re-attached, zeroed, at the next step), replacing `.grad` is an error.
    `backend`: the captured tree path (BACKENDS), or "auto": masked where
    `tree_attention.choose_backend` gives the row masked, else varlen; `steps`: bucket
    granularity (default `STEPS`)."""

    def __init__(self, model, loss_fn: LossFn, *, temperature: float = 1.0,
                 capture: bool | None = None, backend: str = "varlen",
                 steps: dict[str, int] | None = None):
        _check_model(model)
        if backend not in (*BACKENDS, "auto"):
            raise ValueError(f"row graphs backend {backend!r}: choose 'auto' or one of "
                             f"{BACKENDS}")
        self.model, self.loss_fn, self.temperature = model, loss_fn, temperature
        self.backend, self.steps = backend, steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.capture = self.device.type == "cuda" if capture is None else capture
        cuda = self.device.type == "cuda"
        self.head_dim = attention_head_dim(model.config)
        self.kernels = {
            "levels": "flash" if cuda else "reference",
            "varlen": varlen_attention.varlen_kernel() if cuda else varlen_attention.sdpa_varlen,
        }
        self.grads: list[torch.Tensor] | None = None
        self.buffers: dict[Bucket, dict[str, torch.Tensor]] = {}
        self.outputs: dict[Bucket, tuple[TokenLogprobs, torch.Tensor]] = {}
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.pool = None
        # warm-ups and captures run on this one side stream (PyTorch's recipe): per-stream
        # state made during a warm-up (library workspaces, autograd's gradient-accumulation
        # streams) is then the capture's own, and nothing in the capture touches the legacy
        # default stream, which CUDA refuses while a stream captures
        self.stream: torch.cuda.Stream | None = None

    @staticmethod
    def supports(row: PackedRow) -> bool:
        """Rows a graph can take: trained tokens, and no sampler candidate sets (top-k/top-p
        sampling masks differ in width from row to row)."""
        return row.num_trained > 0 and row.sampling_mask is None

    def step(self, row: PackedRow, scale: float = 1.0) -> RowStep:
        if not self.supports(row):
            raise ValueError("row graphs take rows with trained tokens and no sampling mask; "
                             "run this row eagerly (RowGraphs.supports).")
        bucket = self.bucket(row)
        if bucket not in self.buffers:
            self.prepare([row])
        self.attach_grads()
        static = self.buffers[bucket]
        for name, value in padded_inputs(row, bucket).items():
            src = value.pin_memory() if self.device.type == "cuda" else value
            static[name].copy_(src, non_blocking=True)
        static["scale"].fill_(scale)
        if self.capture:
            self.graphs[bucket].replay()
            token, loss = self.outputs[bucket]
        else:
            token, loss = self._run(bucket)
        t = row.num_trained
        topk = None if token.topk_logprobs is None else token.topk_logprobs[:t]
        return RowStep(TokenLogprobs(token.logprobs[:t], token.entropy[:t], topk), loss, static)

    def prepare(self, rows: list[PackedRow]) -> None:
        """Make the graphs of these rows' buckets (an optimizer step's micro-batches), largest
        first. Each new bucket first runs one eager warm-up step (compilation, kernel choice,
        workspaces) with scale 0 and every trained entry's `valid` 0: it adds exactly zero to
        the gradients. All warm-ups run before any capture and their cached
        blocks are handed back, so the captures can take that memory; the largest bucket is
        captured first, so the smaller ones fit into the blocks it freed. (Captured in the
        order rows arrive, buckets of growing sizes each needed new blocks: on an H200 the
        pool held 15.9-16.1 GiB for 3-4 buckets, largest first 12.1: docs/performance.md.)"""
        buckets = {self.bucket(r): r for r in rows if self.supports(r)}
        new = sorted(((b, r) for b, r in buckets.items() if b not in self.buffers),
                     key=lambda item: dataclasses.astuple(item[0]), reverse=True)
        if not new:
            return
        self.attach_grads()
        for bucket, row in new:
            inputs = padded_inputs(row, bucket)
            inputs["valid"] = torch.zeros_like(inputs["valid"])
            self.buffers[bucket] = {k: v.to(self.device) for k, v in inputs.items()}
        if not self.capture:
            for bucket, _ in new:
                self._run(bucket)
            return
        if self.stream is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            for bucket, _ in new:
                self._run(bucket)
            torch.cuda.empty_cache()
            for bucket, _ in new:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    self.outputs[bucket] = self._run(bucket)
                self.graphs[bucket] = graph
        caller.wait_stream(self.stream)

    def bucket(self, row: PackedRow) -> Bucket:
        """The row's bucket: its tree path (`backend`, "auto" resolved) and padded sizes."""
        backend = self.backend
        if backend == "auto":
            chosen = tree_attention.choose_backend(self.device, self.params[0].dtype,
                                                   row.num_tokens, self.head_dim)
            backend = "masked" if chosen == "masked" else "varlen"
        return Bucket.of(row, backend, self.steps)

    def _run(self, bucket: Bucket) -> tuple[TokenLogprobs, torch.Tensor]:
        """The padded step on the bucket's static buffers: what a graph captures."""
        s = self.buffers[bucket]
        tree = TreeMask(segment_ids=None, ancestors=None, position_ids=s["position_ids"],
                        backend=bucket.backend)
        if bucket.backend == "masked":  # the lists from `until`: tensor ops, no host wait
            tree.masked = masked_attention.MaskedPlan.build(
                s["until"], tree_attention.masked_kernel(self.device, self.params[0].dtype),
                masked_attention.key_block(self.head_dim))
        elif bucket.backend == "levels":  # depth parts on the varlen kernel (no padded batches)
            depths = range(len(bucket.depths))
            tree.levels = level_attention.LevelPlan(
                self.kernels["levels"], s["cu_q"], bucket.max_q,
                query_index=[s[f"depth{d}_q"] for d in depths],
                key_index=[s[f"depth{d}_k"] for d in depths],
                cu_q=[s[f"depth{d}_cu_q"] for d in depths],
                cu_k=[s[f"depth{d}_cu_k"] for d in depths],
                max_q=[b.max_q for b in bucket.depths], max_k=[b.max_k for b in bucket.depths],
                merge=level_merge.check(level_merge.MERGE),
            )
        else:
            tree.varlen = varlen_attention.VarlenPlan(
                kernel=self.kernels["varlen"], cu_q=s["cu_q"], cu_k=s["cu_k"], max_q=bucket.max_q,
                max_k=bucket.max_k, kv_index=s["kv_index"],
            )
        hidden = self.model.get_decoder()(
            input_ids=s["input_ids"][None], position_ids=s["position_ids"][None],
            use_cache=False, tree_mask=tree,
        ).last_hidden_state[0]
        token = token_logprobs(hidden[s["pred_index"]], self.model.get_output_embeddings().weight,
                               s["targets"], temperature=self.temperature,
                               topk_ids=s.get("topk_ids"))
        loss = self.loss_fn(token, s) * s["scale"]
        loss.backward()
        topk = None if token.topk_logprobs is None else token.topk_logprobs.detach()
        return TokenLogprobs(token.logprobs.detach(), token.entropy.detach(), topk), loss.detach()

    def attach_grads(self) -> None:
        """Give every parameter the fixed gradient tensor the graphs accumulate into."""
        if self.grads is None:
            self.grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                          for p in self.params]
        cleared = []
        for p, g in zip(self.params, self.grads):
            if p.grad is None:
                cleared.append(g)
                p.grad = g
            elif p.grad is not g:
                raise RuntimeError(
                    "a parameter's .grad was replaced after its row graphs were captured; the "
                    "graphs add into the original tensors. Clear gradients with "
                    "zero_grad(set_to_none=True) or in place, never by assigning new tensors."
                )
        if cleared:
            torch._foreach_zero_(cleared)


def _check_model(model) -> None:
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            "row graphs need a model in tree-attention mode: call "
            "grpo_agent.train.tree_attention.enable_tree_attention(model) first."
        )
    text = model.config.get_text_config()
    if getattr(model, "_grpo_linear_layers", 0) or getattr(text, "use_sliding_window", False):
        raise ValueError(
            "row graphs capture the varlen, level and masked tree paths only: models with Gated "
            "DeltaNet or sliding-window layers take other paths. Turn graphs off for this model."
        )
