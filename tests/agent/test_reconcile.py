"""Property tests of fork reconciliation on synthetic multi-turn conversations.

A tiny token-level "chat template" renders a conversation; one variant keeps earlier
`<think>` blocks (prefix-preserving: no forks), the other drops them from history (every turn
after one that thought forks). Generated tokens get unique ids so we can check that each one
is trained exactly once, with its own sampler log-prob.
"""
from __future__ import annotations

import itertools
import math

import pytest
from grpo_agent.rollout.reconcile import ReconcileStats, common_prefix_length, reconcile_turns
from grpo_agent.types import TurnRecord
from hypothesis import given, settings
from hypothesis import strategies as st

USER, ASSISTANT, TOOL, END, THINK, UNTHINK = 1, 2, 3, 4, 5, 6


def render(history: list[dict], keep_think: bool) -> list[int]:
    """Render messages plus the generation prompt, like a ChatML template at token level."""
    ids: list[int] = []
    for message in history:
        if message["role"] == "assistant":
            think = message["think"] if keep_think else []
            ids += [ASSISTANT, *think, *message["answer"], END]
        else:
            ids += [USER if message["role"] == "user" else TOOL, *message["content"], END]
    return ids + [ASSISTANT]


def logprob_of(token: int) -> float:
    return -token / 10_000


turn_spec = st.tuples(
    st.integers(0, 3),  # thinking tokens generated
    st.integers(1, 4),  # answer tokens generated
    st.integers(1, 3),  # tool-result tokens appended after the turn
    st.lists(st.integers(0, 1), min_size=7, max_size=7),  # output mask bits
)


def simulate(specs, keep_think: bool, with_mask: bool = False, with_top: bool = False):
    """Build the TurnRecords a tool loop would record for the given turn shapes."""
    history: list[dict] = [{"role": "user", "content": [10, 11, 12]}]
    next_token = 1000
    turns = []
    for think_len, answer_len, tool_len, bits in specs:
        prompt = render(history, keep_think)
        think = [THINK, *range(next_token, next_token + think_len), UNTHINK] if think_len else []
        next_token += think_len
        answer = list(range(next_token, next_token + answer_len))
        next_token += answer_len
        output = [*think, *answer, END]
        mask = [bits[i % len(bits)] for i in range(len(output))] if with_mask else None
        top = [{t: logprob_of(t)} for t in output] if with_top else None
        turns.append(
            TurnRecord(
                prompt_ids=prompt,
                output_ids=output,
                output_log_probs=[logprob_of(t) for t in output],
                output_mask=mask,
                output_sampler_logprobs=top,
            )
        )
        history.append({"role": "assistant", "think": think, "answer": answer})
        history.append({"role": "tool", "content": list(range(20, 20 + tool_len))})
    return turns


def trained_tokens(sequences) -> list[int]:
    return [t for s in sequences for t, m in zip(s.token_ids, s.trained_mask) if m]


def expected_trained(turns) -> list[int]:
    out = []
    for turn in turns:
        mask = turn.output_mask or [1] * len(turn.output_ids)
        out += [t for t, m in zip(turn.output_ids, mask) if m]
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(turn_spec, min_size=1, max_size=6), st.booleans(), st.booleans())
def test_every_generated_token_is_trained_exactly_once(specs, keep_think, with_mask):
    turns = simulate(specs, keep_think, with_mask=with_mask)
    sequences, stats = reconcile_turns(turns)
    assert trained_tokens(sequences) == expected_trained(turns)
    for seq in sequences:
        assert len(seq.trained_mask) == len(seq.token_ids) == len(seq.sampler_logprobs)
        for token, trained, logprob in zip(seq.token_ids, seq.trained_mask, seq.sampler_logprobs):
            # Masked-out generated tokens keep their sampler log-prob; context gets 0.0.
            assert logprob == logprob_of(token) if trained else logprob in (0.0, logprob_of(token))
        assert seq.num_trained > 0
    assert stats.num_transitions == len(turns) - 1
    assert len(stats.drift_tokens) == stats.num_transitions


@settings(max_examples=100, deadline=None)
@given(st.lists(turn_spec, min_size=1, max_size=6))
def test_prefix_preserving_template_yields_one_sequence_without_forks(specs):
    turns = simulate(specs, keep_think=True)
    sequences, stats = reconcile_turns(turns)
    assert len(sequences) == 1
    assert stats.num_forks == 0 and set(stats.drift_tokens) <= {0}
    assert sequences[0].token_ids == turns[-1].prompt_ids + turns[-1].output_ids
    tool_and_prompt = [
        t for t, m in zip(sequences[0].token_ids, sequences[0].trained_mask) if not m
    ]
    assert tool_and_prompt[:4] == [USER, 10, 11, 12]


@settings(max_examples=200, deadline=None)
@given(st.lists(turn_spec, min_size=1, max_size=6))
def test_dropping_think_from_history_forks_after_every_thinking_turn(specs):
    turns = simulate(specs, keep_think=False)
    sequences, stats = reconcile_turns(turns)
    thinking_turns = [think_len > 0 for think_len, *_ in specs]
    expected_forks = sum(thinking_turns[:-1])
    assert stats.num_forks == expected_forks
    assert len(sequences) == expected_forks + 1
    # Each sequence starts with the full prompt of the turn that opened it; the shared prefix
    # with the previous sequence is exactly what the rewritten prompt kept.
    openers = [turns[0]] + [t for t, thought in zip(turns[1:], thinking_turns) if thought]
    for seq, opener in zip(sequences, openers):
        assert seq.token_ids[: len(opener.prompt_ids)] == opener.prompt_ids
        assert not any(seq.trained_mask[: len(opener.prompt_ids)])
    for previous, following in itertools.pairwise(sequences):
        shared = common_prefix_length(previous.token_ids, following.token_ids)
        assert shared >= 4  # at least the user prompt is shared
    for drift, thought in zip(stats.drift_tokens, thinking_turns):
        assert (drift > 0) == thought
    if stats.num_transitions:
        assert math.isclose(stats.fork_frac, expected_forks / stats.num_transitions)


@settings(max_examples=50, deadline=None)
@given(st.lists(turn_spec, min_size=1, max_size=5), st.booleans())
def test_top_logprobs_travel_with_their_tokens_and_context_gets_none(specs, keep_think):
    turns = simulate(specs, keep_think, with_top=True)
    sequences, _ = reconcile_turns(turns)
    for seq in sequences:
        assert len(seq.sampler_top_logprobs) == len(seq.token_ids)
        assert seq.sampling_mask is None
        for token, trained, top in zip(seq.token_ids, seq.trained_mask, seq.sampler_top_logprobs):
            if trained:
                assert top == {token: logprob_of(token)}
            else:
                assert top is None or top == {token: logprob_of(token)}


def test_drift_counts_rewritten_held_tokens():
    first = TurnRecord(prompt_ids=[1, 2, 3], output_ids=[7, 8, 9], output_log_probs=[-1.0] * 3)
    # The re-render keeps [1, 2, 3, 7] and rewrites [8, 9]: 2 drift tokens.
    second = TurnRecord(prompt_ids=[1, 2, 3, 7, 4, 5], output_ids=[6], output_log_probs=[-0.5])
    sequences, stats = reconcile_turns([first, second])
    assert stats == ReconcileStats(num_transitions=1, num_forks=1, drift_tokens=[2])
    assert [s.token_ids for s in sequences] == [[1, 2, 3, 7, 8, 9], [1, 2, 3, 7, 4, 5, 6]]
    assert [s.trained_mask for s in sequences] == [[0, 0, 0, 1, 1, 1], [0] * 6 + [1]]


def test_a_single_rewritten_token_is_a_fork():
    """The boundary: a re-render that changes only the last generated token (a template that
    re-renders the end-of-turn token) no longer extends the sequence."""
    first = TurnRecord(prompt_ids=[1, 2], output_ids=[7, 8, 9], output_log_probs=[-1.0] * 3)
    second = TurnRecord(prompt_ids=[1, 2, 7, 8, 4], output_ids=[6], output_log_probs=[-0.5])
    sequences, stats = reconcile_turns([first, second])
    assert stats == ReconcileStats(num_transitions=1, num_forks=1, drift_tokens=[1])
    assert [s.token_ids for s in sequences] == [[1, 2, 7, 8, 9], [1, 2, 7, 8, 4, 6]]


def test_fully_masked_rollout_yields_no_sequence():
    turn = TurnRecord(prompt_ids=[1], output_ids=[2, 3], output_log_probs=[-1, -1], output_mask=[0, 0])
    sequences, stats = reconcile_turns([turn])
    assert sequences == [] and stats.num_transitions == 0
    assert math.isnan(stats.fork_frac)


def test_misaligned_columns_name_the_problem():
    turn = TurnRecord(prompt_ids=[1], output_ids=[2, 3], output_log_probs=[-1.0])
    with pytest.raises(ValueError, match="output_log_probs has 1 entries but output_ids has 2"):
        reconcile_turns([turn])


def test_trained_tokens_without_sampler_log_probs_are_refused():
    """The spec makes output_log_probs required when any output token is trained (a custom
    generate_one used to get zeros, i.e. importance ratios against probability 1)."""
    turn = TurnRecord(prompt_ids=[1], output_ids=[2, 3, 4], output_mask=[1, 0, 1])
    with pytest.raises(ValueError, match="turn 0: output_log_probs is empty but 2 of its 3 output "
                                         "tokens are trained"):
        reconcile_turns([turn])
    context_only = TurnRecord(prompt_ids=[1], output_ids=[2, 3], output_mask=[0, 0])
    assert reconcile_turns([context_only])[0] == []  # nothing trained: no log-probs needed


def test_optional_columns_keep_one_entry_per_token_when_turns_carry_them_or_not():
    """A sampling mask on the first turn only, top log-probs on the second only, and a third
    turn of context-only tokens without log-probs: every column has one entry per token,
    with placeholders where a turn carried nothing."""
    first = TurnRecord(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.3, -0.4],
                       output_sampling_mask=[[3], [4]])
    second = TurnRecord(prompt_ids=[1, 2, 3, 4, 5], output_ids=[6], output_log_probs=[-0.6],
                        output_sampler_logprobs=[{6: -0.6}])
    third = TurnRecord(prompt_ids=[1, 2, 3, 4, 5, 6, 7], output_ids=[8, 9], output_mask=[0, 0])
    [sequence], _ = reconcile_turns([first, second, third])
    assert sequence.token_ids == list(range(1, 10))
    assert sequence.trained_mask == [0, 0, 1, 1, 0, 1, 0, 0, 0]
    assert sequence.sampler_logprobs == [0.0, 0.0, -0.3, -0.4, 0.0, -0.6, 0.0, 0.0, 0.0]
    assert sequence.sampling_mask == [None, None, [3], [4], None, None, None, None, None]
    assert [sequence.sampler_top_logprobs[t] for t in range(9)] == [None] * 5 + [{6: -0.6}] + [None] * 3


@pytest.mark.parametrize("column, values", [
    ("output_mask", [1]),
    ("output_sampler_logprobs", [{2: -1.0}]),
    ("output_sampling_mask", [[2], [3], [4]]),
])
def test_every_misaligned_column_is_named(column, values):
    turn = TurnRecord(prompt_ids=[1], output_ids=[2, 3], output_log_probs=[-1.0, -1.0], **{column: values})
    with pytest.raises(ValueError, match=f"turn 0: {column} has {len(values)} entries but output_ids has 2"):
        reconcile_turns([turn])
