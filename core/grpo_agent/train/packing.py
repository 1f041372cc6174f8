"""Tree packing: a row is a prefix trie of its samples, laid out depth-first.

Design decision: a trie node is one forwarded token, and a node may carry at most ONE trained
target. Samples share a node when their paths are identical up to and including it and at
most one of them trains the token that follows it. This is the spec's rule ("a position
predicts one token"): two rollouts of one prompt share the prompt except its last token,
because that position predicts a different trained token in each; a fork that only re-reads
another sample's completion as context shares it fully. Each trained token keeps its own
target, advantage and sampler log-probs, read at the index of the token before it.

Segments are maximal chains of the trie without branches. Attention only needs, for each
segment, which segments lie on its path (`ancestors`): a query attends to keys of ancestor
segments and to earlier keys of its own segment. Only torch is imported here, no model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from grpo_agent.top_logprobs import PAD_ID, as_top_logprobs
from grpo_agent.types import TrainingSample

NO_TARGET = -1


@dataclass(slots=True)
class _Node:
    token: int
    depth: int
    target_owner: int = NO_TARGET  # index (in the row) of the sample that trains the next token
    children: list[_Node] = field(default_factory=list)
    index: int = -1  # position in the depth-first layout


class PrefixTrie:
    """Incremental trie over token sequences; `added_tokens` previews the cost of an insert.

    A walk node by node costs a Python step per token, and most samples repeat the previous
    one's prompt (its group's). So a walk first takes, in one step, the prefix it shares with
    the sample inserted last, up to where either claims a trained token: there both walks
    follow the first child with the token, which the last sample's path already is (children
    are only ever appended). Node by node from there."""

    def __init__(self) -> None:
        self.root = _Node(token=NO_TARGET, depth=-1)
        self.num_nodes = 0
        self.attention_cost = 0  # sum over nodes of the keys they attend to (depth + 1)
        self.paths: list[list[_Node]] = []
        self._last: tuple[list[int], int] = ([], 0)  # last inserted tokens, first claim

    def _child(self, node: _Node, token: int, claims_target: bool) -> _Node | None:
        for child in node.children:
            if child.token == token and not (claims_target and child.target_owner != NO_TARGET):
                return child
        return None

    def _shared(self, token_ids: list[int], predicts_trained: list[bool]) -> list[_Node]:
        """The existing nodes this sequence would share, one per token from its start."""
        token_ids = _as_list(token_ids)
        last_tokens, last_claim = self._last
        limit = min(last_claim, _first_claim(predicts_trained))
        path = self.paths[-1][:_common_prefix(last_tokens, token_ids, limit)] if self.paths else []
        node = path[-1] if path else self.root
        for depth in range(len(path), len(token_ids)):
            node = self._child(node, token_ids[depth], predicts_trained[depth])
            if node is None:
                break
            path.append(node)
        return path

    def added_tokens(self, token_ids: list[int], predicts_trained: list[bool]) -> tuple[int, int]:
        """(new nodes, added attention cost) if this sequence were inserted."""
        shared, total = len(self._shared(token_ids, predicts_trained)), len(token_ids)
        return total - shared, _added_cost(total, shared)

    def insert(self, token_ids: list[int], predicts_trained: list[bool]) -> list[_Node]:
        """Insert one sample; returns its path (one node per token)."""
        token_ids = _as_list(token_ids)
        owner, total, first = len(self.paths), len(token_ids), _first_claim(predicts_trained)
        path = self._shared(token_ids, predicts_trained)
        shared = len(path)
        self.num_nodes += total - shared
        self.attention_cost += _added_cost(total, shared)
        for depth in range(first, shared):
            if predicts_trained[depth]:
                path[depth].target_owner = owner
        node = path[-1] if path else self.root
        for depth in range(shared, total):
            child = _Node(token=token_ids[depth], depth=depth)
            if predicts_trained[depth]:
                child.target_owner = owner
            node.children.append(child)
            path.append(child)
            node = child
        self.paths.append(path)
        self._last = (token_ids, first)
        return path


def _as_list(token_ids) -> list[int]:
    """Token ids as a list (tuples or arrays would not compare as slices of one)."""
    return token_ids if isinstance(token_ids, list) else list(token_ids)


def _added_cost(total: int, shared: int) -> int:
    """Attention cost of the nodes at depths shared..total-1: sum of (depth + 1)."""
    return (total * (total + 1) - shared * (shared + 1)) // 2


def _first_claim(predicts_trained: list[bool]) -> int:
    """The first position that predicts a trained token (the length if none does)."""
    try:
        return predicts_trained.index(True)
    except ValueError:
        return len(predicts_trained)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit` (slices compare in C)."""
    lo, hi = 0, min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def predicts_trained(sample: TrainingSample) -> list[bool]:
    """Per position: does this position predict a trained token of the sample?"""
    mask = sample.sequence.trained_mask
    return [bool(m) for m in mask[1:]] + [False]


@dataclass
class PackedRow:
    """One packed row: forwarded tokens plus one entry per trained token (its loss inputs)."""

    input_ids: torch.Tensor  # [N] long
    position_ids: torch.Tensor  # [N] long, depth of the token in its sample
    segment_ids: torch.Tensor  # [N] long
    segment_paths: list[list[int]]  # per segment: token indices of its path (ancestors + itself)
    segment_ancestors: torch.Tensor  # [S, S] bool: [s, a] = a is s or an ancestor of s
    # Per trained token (T entries):
    pred_index: torch.Tensor  # [T] index of the token before it in its sample
    targets: torch.Tensor  # [T] the trained token id
    advantages: torch.Tensor  # [T] float
    sampler_logprobs: torch.Tensor  # [T] float
    token_sample: torch.Tensor  # [T] which sample of the row (per-completion metrics)
    sampler_topk_ids: torch.Tensor | None  # [T, K] long, -1 padding
    sampler_topk_logprobs: torch.Tensor | None  # [T, K] float, -inf padding
    sampling_mask: torch.Tensor | None  # [T, M] long candidate ids, -1 padding
    num_samples: int
    unpacked_tokens: int  # tokens the samples would forward one by one
    group_ids: list[int] = field(default_factory=list)  # group of each sample, in row order

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_trained(self) -> int:
        return int(self.targets.numel())

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0


def pack_row(samples: list[TrainingSample], trie: PrefixTrie | None = None) -> PackedRow:
    """Build the tree-packed row of `samples` (order decides which sample owns shared nodes).

    `trie`: one that already holds exactly `samples`, inserted in this order (the step
    planner's), so they are not inserted a second time."""
    if trie is None:
        trie = PrefixTrie()
        for s in samples:
            trie.insert(s.sequence.token_ids, predicts_trained(s))
    if len(trie.paths) != len(samples):
        raise ValueError(f"the trie holds {len(trie.paths)} samples, not the row's {len(samples)}")
    paths = trie.paths
    input_ids, positions, segments, seg_paths, seg_parent = _layout(trie)
    ancestors = _ancestor_matrix(seg_parent)
    trained = _trained_entries(samples, paths)
    return PackedRow(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        segment_ids=torch.tensor(segments, dtype=torch.long),
        segment_paths=seg_paths,
        segment_ancestors=ancestors,
        num_samples=len(samples),
        unpacked_tokens=sum(s.num_tokens for s in samples),
        group_ids=[s.group_id for s in samples],
        **trained,
    )


def _layout(trie: PrefixTrie):
    """Depth-first layout; a new segment starts at every child of a branching node."""
    input_ids: list[int] = []
    positions: list[int] = []
    segments: list[int] = []
    seg_paths: list[list[int]] = []
    seg_parent: list[int] = []
    # stack of (node, parent segment, starts a new segment)
    stack = [(c, -1) for c in reversed(trie.root.children)]
    while stack:
        node, parent_seg = stack.pop()
        seg = len(seg_paths)
        seg_parent.append(parent_seg)
        seg_paths.append(list(seg_paths[parent_seg]) if parent_seg >= 0 else [])
        while True:
            node.index = len(input_ids)
            input_ids.append(node.token)
            positions.append(node.depth)
            segments.append(seg)
            seg_paths[seg].append(node.index)
            if len(node.children) != 1:
                break
            node = node.children[0]
        stack.extend((c, seg) for c in reversed(node.children))
    return input_ids, positions, segments, seg_paths, seg_parent


def _ancestor_matrix(seg_parent: list[int]) -> torch.Tensor:
    n = len(seg_parent)
    anc = np.zeros((n, n), dtype=bool)
    for s in range(n):
        a = s
        while a >= 0:
            anc[s, a] = True
            a = seg_parent[a]
    return torch.from_numpy(anc)


def _trained_entries(samples: list[TrainingSample], paths: list[list[_Node]]) -> dict:
    pred, targets, adv, lps, owner = [], [], [], [], []
    topk: list[tuple[np.ndarray, np.ndarray]] = []
    masks: list[list[int] | None] = []
    for i, (sample, path) in enumerate(zip(samples, paths)):
        seq = sample.sequence
        positions = [t for t in range(1, len(seq.token_ids)) if seq.trained_mask[t]]
        pred += [path[t - 1].index for t in positions]
        targets += [seq.token_ids[t] for t in positions]
        adv += [sample.advantage] * len(positions)
        lps += [seq.sampler_logprobs[t] for t in positions]
        owner += [i] * len(positions)
        if seq.sampler_top_logprobs:
            topk.append(as_top_logprobs(seq.sampler_top_logprobs).rows(np.asarray(positions, dtype=np.int64)))
        else:
            topk.append((np.full((len(positions), 0), PAD_ID), np.full((len(positions), 0), -np.inf)))
        masks += [seq.sampling_mask[t] for t in positions] if seq.sampling_mask else [None] * len(positions)
    topk_ids, topk_lps = _pad_topk(topk)
    return {
        "pred_index": torch.tensor(pred, dtype=torch.long),
        "targets": torch.tensor(targets, dtype=torch.long),
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "sampler_logprobs": torch.tensor(lps, dtype=torch.float32),
        "token_sample": torch.tensor(owner, dtype=torch.long),
        "sampler_topk_ids": topk_ids,
        "sampler_topk_logprobs": topk_lps,
        "sampling_mask": _pad_ids(masks),
    }


def _pad_topk(blocks: list[tuple[np.ndarray, np.ndarray]]):
    """[tokens, k] ids (-1 pad) and log-probs (-inf pad) of every sample's trained tokens,
    filled block by block (a Python loop per token cost more than the row's forward)."""
    width = max((ids.shape[1] for ids, _ in blocks), default=0)
    if width == 0:
        return None, None
    total = sum(ids.shape[0] for ids, _ in blocks)
    ids = np.full((total, width), PAD_ID, dtype=np.int64)
    lps = np.full((total, width), -np.inf, dtype=np.float32)
    start = 0
    for block_ids, block_lps in blocks:
        end, k = start + block_ids.shape[0], block_ids.shape[1]
        ids[start:end, :k], lps[start:end, :k] = block_ids, block_lps
        start = end
    return torch.from_numpy(ids), torch.from_numpy(lps)


def _pad_ids(lists: list[list[int] | None]) -> torch.Tensor | None:
    if not any(lists):
        return None
    if not all(lists):
        raise ValueError(
            "sampling_mask is set for some trained tokens but not others; the rollout side must "
            "give every trained token its candidate set (or none at all)."
        )
    width = max(len(x) for x in lists)
    return torch.tensor([[*ids, *([-1] * (width - len(ids)))] for ids in lists], dtype=torch.long)
