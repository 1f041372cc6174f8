"""Built-in rewards, advantage estimator, prompt filter and the curriculum plugin."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from grpo_agent.plugins import build_registry
from grpo_agent.rewards import accuracy_reward, completion_text, format_reward


def _completions(*texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_accuracy_reward_matches_boxed_answers_and_returns_none_for_unparseable_gold():
    rewards = accuracy_reward(
        _completions("so \\boxed{12}", "it is \\boxed{13}", "\\boxed{\\frac{1}{2}}", "\\boxed{1}"),
        solution=["12", "12", "0.5", "not a number at all"],
    )
    assert rewards == [1.0, 0.0, 1.0, None]


def test_accuracy_reward_scores_the_last_assistant_message_of_a_tool_conversation():
    completion = [
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "\\boxed{7}"},
        {"role": "assistant", "content": "Done: \\boxed{8}"},
    ]
    assert accuracy_reward([completion], solution=["8"]) == [1.0]


def test_format_reward_wants_one_leading_think_block():
    assert format_reward(_completions("<think>a</think> b", "b", "<think>a<think></think>")) == [
        1.0, 0.0, 0.0]


def test_rewards_score_plain_string_completions_as_trl_does():
    """A dataset in TRL's standard (non-conversational) format gives completions as strings."""
    assert accuracy_reward(["so \\boxed{12}", "\\boxed{13}"], solution=["12", "12"]) == [1.0, 0.0]
    assert format_reward(["<think>a</think> b", "b"]) == [1.0, 0.0]


def test_a_message_without_a_role_is_the_assistants_and_missing_content_is_empty_text():
    """A tool-calling turn may end on an assistant message whose content is None."""
    assert completion_text([{"role": "user", "content": "q"}, {"content": "<think>a</think>"}]) == (
        "<think>a</think>")
    tool_call_only = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert completion_text(tool_call_only) == ""
    assert format_reward([tool_call_only]) == [0.0]
    assert completion_text([{"role": "user", "content": "q"}]) == ""


def test_accuracy_reward_refuses_completions_and_solutions_of_different_lengths():
    """Scoring the shorter list only would shift rewards onto the wrong rollouts."""
    with pytest.raises(ValueError):
        accuracy_reward(_completions("\\boxed{1}", "\\boxed{2}"), solution=["1"])


def test_group_norm_normalises_scored_rewards_and_zeroes_nan_and_flat_groups():
    group_norm = build_registry().resolve_advantage_estimator("group_norm")
    advantages = group_norm(SimpleNamespace(rewards=np.array([1.0, 0.0, np.nan, 1.0, 0.0])))
    np.testing.assert_allclose(advantages, [1.0, -1.0, 0.0, 1.0, -1.0])
    assert not group_norm(SimpleNamespace(rewards=np.array([1.0, 1.0]))).any()
    assert not group_norm(SimpleNamespace(rewards=np.array([np.nan, 2.0]))).any()
    # two scored rewards are enough for a spread (the unscored third gets 0)
    np.testing.assert_allclose(group_norm(SimpleNamespace(rewards=np.array([3.0, np.nan, 1.0]))),
                               [1.0, 0.0, -1.0])


def test_all_prompt_filter_accepts_everything():
    assert build_registry().resolve_prompt_filter("all")(3, {"prompt": "x"}, 7) is True


def test_curriculum_records_pass_rates_and_filters_solved_prompts(monkeypatch):
    import grpo_agent_curriculum as curriculum
    from grpo_agent.plugins import load_registry

    monkeypatch.setattr(curriculum, "PASS_RATES", {})
    registry = load_registry()  # the installed plugin, found through its entry point
    args = {"curriculum": {"pass_rate_cap": "0.75"}}  # as --plugin-arg gives it: text
    keep = registry.bind_plugin("prompt_filter", "curriculum", args)
    estimate = registry.bind_plugin("advantage_estimator", "curriculum", args)
    solved = SimpleNamespace(rewards=np.array([1.0, 1.0, 1.0, 0.0]), row_index=4)
    hard = SimpleNamespace(rewards=np.array([1.0, 0.0, np.nan, 0.0]), row_index=5)
    np.testing.assert_allclose(estimate(solved), [0.57735, 0.57735, 0.57735, -1.73205], atol=1e-5)
    estimate(hard)
    assert curriculum.PASS_RATES == {4: 0.75, 5: 1 / 3}
    assert keep(4, {}, 1) is False
    assert keep(5, {}, 1) is True
    assert keep(6, {}, 1) is True
    # the declared default (0.9) applies without plugin_args: 0.75 < 0.9 keeps row 4
    assert registry.bind_plugin("prompt_filter", "curriculum", None)(4, {}, 1) is True


def test_format_reward_takes_a_think_block_over_several_lines():
    # A model's reasoning runs over lines; without re.DOTALL every such completion would score 0.
    assert format_reward(["<think>first\nthen</think>\nanswer", "<think>a\n</think>"]) == [1.0, 1.0]
    assert format_reward(["<think>a\n<think>b</think>"]) == [0.0]


def test_accuracy_reward_reads_a_solution_column_of_numbers_as_text():
    # A dataset whose `solution` column holds ints (datasets infers int64) reaches the reward
    # as numbers: math-verify parses text only.
    assert accuracy_reward(_completions("\\boxed{12}", "\\boxed{13}"), solution=[12, 12]) == [1.0, 0.0]


def test_letter_fraction_is_the_share_of_letters_among_non_space_characters():
    # The `words` demo's reward: spaces are not characters of the answer, digits are not letters.
    from grpo_agent.demo import letter_fraction

    assert letter_fraction(["forty two", "42", "a1 b2", "", " "]) == [1.0, 0.0, 0.5, 0.0, 0.0]
    assert letter_fraction(_completions("six 6")) == [0.75]


def test_curriculum_records_a_solved_group_and_skips_an_unscored_one(monkeypatch):
    # compute_advantages runs on groups the run drops: a solved group (all pass, zero std) is the
    # one whose prompt the filter must skip from then on; a group nothing scored has no pass
    # rate (np.mean of nothing is NaN, and NaN < cap is False: its prompt would be skipped for good).
    import grpo_agent_curriculum as curriculum
    from grpo_agent.plugins import load_registry

    monkeypatch.setattr(curriculum, "PASS_RATES", {})
    registry = load_registry()
    keep = registry.bind_plugin("prompt_filter", "curriculum", None)
    estimate = registry.bind_plugin("advantage_estimator", "curriculum", None)
    assert not estimate(SimpleNamespace(rewards=np.array([1.0, 1.0, 1.0]), row_index=1)).any()
    assert not estimate(SimpleNamespace(rewards=np.array([np.nan, np.nan]), row_index=2)).any()
    assert curriculum.PASS_RATES == {1: 1.0}
    assert keep(1, {}, 1) is False
    assert keep(2, {}, 1) is True
