"""Property test: for any set of samples, every trained token of the packed row sees exactly
its own sample's history, and each forwarded position predicts at most one trained token."""

from __future__ import annotations

from grpo_agent.train.batching import attention_cost
from grpo_agent.train.packing import PrefixTrie, pack_row, predicts_trained
from grpo_agent.train.tree_attention import dense_tree_mask
from grpo_agent.types import TrainingSample, TrainingSequence
from hypothesis import given, settings
from hypothesis import strategies as st

# small alphabets and shared stems make prefixes collide often
tokens = st.lists(st.integers(1, 3), min_size=1, max_size=6)
sample_spec = st.tuples(st.sampled_from([[1, 2], [1, 2, 3], [2]]), tokens, st.lists(st.booleans()))


def _sample(stem, tail, flags, advantage=1.0):
    ids = stem + tail
    mask = [int(flags[i]) if i < len(flags) else 1 for i in range(len(ids))]
    # a distinct sampler log-prob per position: -(t + 1) / 8 (exact in float32)
    seq = TrainingSequence(ids, mask, [-(t + 1) / 8 for t in range(len(ids))])
    return TrainingSample(seq, advantage=advantage, model_version=0, group_id=0, row_index=0)


@settings(max_examples=150, deadline=None)
@given(st.lists(sample_spec, min_size=1, max_size=6))
def test_every_trained_token_sees_exactly_its_history(specs):
    # negative advantages too: a sign lost on the way into the row would train the other way
    samples = [_sample(*spec, advantage=i - 2.5) for i, spec in enumerate(specs)]
    row = pack_row(samples)
    mask = dense_tree_mask(row.segment_ids, row.segment_ancestors)
    ids = row.input_ids.tolist()
    assert row.num_tokens <= row.unpacked_tokens
    assert len(set(row.pred_index.tolist())) == row.num_trained  # one target per position
    expected = [
        (i, t)
        for i, s in enumerate(samples)
        for t in range(1, s.num_tokens)
        if s.sequence.trained_mask[t]
    ]
    assert len(expected) == row.num_trained
    for k, (i, t) in enumerate(expected):
        pred = int(row.pred_index[k])
        seen = [ids[j] for j in mask[pred].nonzero().flatten().tolist()]
        assert seen == samples[i].sequence.token_ids[:t]
        assert int(row.position_ids[pred]) == t - 1
        assert int(row.targets[k]) == samples[i].sequence.token_ids[t]
        assert int(row.token_sample[k]) == i
        # the trained token's own sampler log-prob (position t, not the one before it)
        assert float(row.sampler_logprobs[k]) == samples[i].sequence.sampler_logprobs[t]
        assert float(row.advantages[k]) == samples[i].advantage


@settings(max_examples=150, deadline=None)
@given(st.lists(sample_spec, min_size=1, max_size=6))
def test_interval_rule_of_the_flex_kernel_equals_the_tree_rule(specs):
    """The FlexAttention mask reads `j <= i < visible_until[j]`; it must be the tree rule."""
    import torch
    from grpo_agent.train.tree_attention import visible_until

    row = pack_row([_sample(*spec) for spec in specs])
    until = visible_until(row.segment_ids, row.segment_ancestors)
    idx = torch.arange(row.num_tokens)
    interval = (idx[None, :] <= idx[:, None]) & (idx[:, None] < until[None, :])
    assert torch.equal(interval, dense_tree_mask(row.segment_ids, row.segment_ancestors))


class _NodeByNodeTrie(PrefixTrie):
    """The walk without the shortcut along the last sample's prefix."""

    def _shared(self, token_ids, predicts_trained):
        path, node = [], self.root
        for token, claims in zip(token_ids, predicts_trained):
            node = self._child(node, token, claims)
            if node is None:
                break
            path.append(node)
        return path


@settings(max_examples=150, deadline=None)
@given(st.lists(sample_spec, min_size=1, max_size=6))
def test_the_shortcut_along_the_last_prefix_builds_the_same_row(specs):
    samples = [_sample(*spec) for spec in specs]
    fast, slow = PrefixTrie(), _NodeByNodeTrie()
    for s in samples:
        claims = predicts_trained(s)
        assert fast.added_tokens(s.sequence.token_ids, claims) == slow.added_tokens(
            s.sequence.token_ids, claims)
        fast.insert(s.sequence.token_ids, claims)
        slow.insert(s.sequence.token_ids, claims)
    assert (fast.num_nodes, fast.attention_cost) == (slow.num_nodes, slow.attention_cost)
    a, b = pack_row(samples, fast), pack_row(samples, slow)
    # the planner's budget numbers are the row's: forwarded tokens, keys attended
    assert fast.num_nodes == a.num_tokens
    assert fast.attention_cost == attention_cost(a) == int((a.position_ids + 1).sum())
    for name in ("input_ids", "position_ids", "segment_ids", "segment_ancestors", "pred_index",
                 "targets", "token_sample"):
        assert getattr(a, name).equal(getattr(b, name)), name
    assert a.segment_paths == b.segment_paths


def test_token_ids_as_tuples_or_arrays_pack_like_lists():
    import numpy as np

    samples = [_sample([1, 2, 3], [1, 2], [0, 0, 0, 1, 1]), _sample([1, 2, 3], [3], [0, 0, 0, 1])]
    trie = PrefixTrie()
    for s, kind in zip(samples, (tuple, np.asarray)):
        trie.insert(kind(s.sequence.token_ids), predicts_trained(s))
    assert pack_row(samples, trie).input_ids.equal(pack_row(samples).input_ids)


def test_a_preview_of_an_insert_is_what_the_insert_adds():
    trie = PrefixTrie()
    for s in [_sample([1, 2], [3, 1], [0, 0, 1, 1]), _sample([1, 2], [3, 2], [0, 0, 1, 1]),
              _sample([1, 2, 3], [1, 3], [0, 0, 0, 0, 1])]:
        claims = predicts_trained(s)
        nodes, cost = trie.added_tokens(s.sequence.token_ids, claims)
        before = (trie.num_nodes, trie.attention_cost)
        trie.insert(s.sequence.token_ids, claims)
        assert (trie.num_nodes - before[0], trie.attention_cost - before[1]) == (nodes, cost)


def test_a_trie_that_does_not_hold_the_rows_samples_is_refused():
    import pytest

    samples = [_sample([1, 2], [3], [0, 0, 1]), _sample([1, 2], [4], [0, 0, 1])]
    trie = PrefixTrie()
    trie.insert(samples[0].sequence.token_ids, predicts_trained(samples[0]))
    with pytest.raises(ValueError, match="the trie holds 1 samples"):
        pack_row(samples, trie)


def test_a_sampling_mask_on_some_trained_tokens_only_is_refused():
    import pytest

    with_mask, without = _sample([1, 2], [3], [0, 0, 1]), _sample([1, 2], [4], [0, 0, 1])
    with_mask.sequence.sampling_mask = [None, None, [3, 5]]
    with pytest.raises(ValueError, match="sampling_mask is set for some trained tokens"):
        pack_row([with_mask, without])
    assert pack_row([with_mask]).sampling_mask.tolist() == [[3, 5]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 2), max_size=12), st.lists(st.integers(1, 2), max_size=12),
       st.integers(0, 14))
def test_the_shortcuts_common_prefix_is_the_longest_one(a, b, limit):
    """The shortcut along the last sample's prefix takes the longest common prefix (at most
    `limit`): a shorter one would only walk node by node again, a longer one share wrongly."""
    from grpo_agent.train.packing import _common_prefix

    naive = 0
    while naive < min(len(a), len(b), limit) and a[naive] == b[naive]:
        naive += 1
    assert _common_prefix(a, b, limit) == naive
