"""The spec's reward-function examples, through `AsyncGRPOTrainer` against the real server.

Each doctest runs as the spec prints it; each function then scores real rollouts of the tiny
model in the rollout worker, and the test checks every value it gave (recorded from the
worker's observations) against the function applied to the same completions' lengths, or
against the sum rule.
"""
from __future__ import annotations

import pytest
from datasets import Dataset
from spec_harness import record_run, spec_args

# Example 1's doctest prompts (spec line 463) as the dataset.
SKY_AND_SUN = Dataset.from_dict({"prompt": [
    [{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}],
]})


def test_example_1_doctest():
    """Spec lines 463-467."""
    from spec_examples.reward_length import reward_func

    prompts = [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}]]  # not used in the reward function, but the trainer will pass it
    completions = [[{"role": "assistant", "content": " blue."}], [{"role": "assistant", "content": " in the sky."}]]  # not used in the reward function, but the trainer will pass it
    completion_ids = [[6303, 13], [304, 279, 12884, 13]]
    assert reward_func(prompts=prompts, completions=completions, completion_ids=completion_ids) == [2.0, 4.0]


def test_example_2_doctest():
    """Spec lines 484-493."""
    from spec_examples.reward_format import format_reward_func

    prompts = [
        [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}],
        [{"role": "user", "content": "What is the result of (3 + 1) * 2?"}],
    ]
    completions = [
        [{"role": "assistant", "content": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12</answer>"}],
        [{"role": "assistant", "content": "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."}],
    ]
    assert format_reward_func(prompts=prompts, completions=completions) == [1.0, 0.0]


def test_example_3_doctest():
    """Spec lines 510-520."""
    from spec_examples.reward_ground_truth import reward_func

    prompts = [
        [{"role": "user", "content": "Solve the equation $2x + 3 = 7$."}],
        [{"role": "user", "content": "Solve the equation $3x - 5 = 10$."}],
    ]
    completions = [
        [{"role": "assistant", "content": r"The solution is \boxed{2}."}],
        [{"role": "assistant", "content": r"The solution is \boxed{6}."}],
    ]
    ground_truth = ["2", "5"]
    assert reward_func(prompts=prompts, completions=completions, ground_truth=ground_truth) == [1.0, 0.0]


@pytest.mark.vllm
@pytest.mark.slow
def test_mixed_sync_and_async_reward_functions_are_summed(spec_server, tmp_path):
    """Spec lines 608-613: example 1 (`reward_func`, sync), example 5's `async_reward_func` and a
    second async function:
    every rollout's reward is the sum of the three functions' rewards, example 1 scores each
    completion by its length, the async ones 1.0, and groups are kept and trained."""
    from grpo_agent import AsyncGRPOTrainer
    from spec_examples.reward_async import async_reward_func, async_reward_func2
    from spec_examples.reward_length import reward_func

    trainer = AsyncGRPOTrainer(
        model=str(spec_server.model_path),
        reward_funcs=[reward_func, async_reward_func, async_reward_func2],
        args=spec_args(spec_server, tmp_path),
        train_dataset=SKY_AND_SUN,
    )
    run = record_run(trainer)

    lengths = run.values("completions/mean_length")
    by_length = run.values("rewards/reward_func/mean")
    assert lengths and by_length == lengths  # example 1: one reward per completion, its length
    assert run.values("rewards/async_reward_func/mean") == [1.0] * len(lengths)
    assert run.values("rewards/async_reward_func2/mean") == [1.0] * len(lengths)
    assert run.values("reward") == [length + 2.0 for length in lengths]  # the sources' sum
    assert not run.values("rollout/reward_error_count")
    assert run.trained and trainer.state.global_step == 1
    assert {"rewards/reward_func/mean", "rewards/async_reward_func/mean",
            "rewards/async_reward_func2/mean", "reward"} <= set(run.logs[-1])


@pytest.mark.vllm
@pytest.mark.slow
def test_examples_2_3_and_4_score_every_rollout_they_apply_to(spec_server, tmp_path):
    """Example 4 as the spec writes it (its dataset, `reward_funcs=[math_reward_func,
    coding_reward_func]`), with examples 2 and 3 in the same list and a `ground_truth` column
    for example 3. Each task-specific function scores exactly the rollouts of its task (None
    elsewhere keeps it out of that rollout), every rollout's reward is the sum of the functions
    that scored it, and the dataset columns reach the functions (no reward raised)."""
    from grpo_agent import AsyncGRPOTrainer
    from spec_examples.reward_format import format_reward_func
    from spec_examples.reward_ground_truth import reward_func
    from spec_examples.reward_multitask import coding_reward_func, dataset, math_reward_func

    dataset = dataset.add_column("ground_truth", ["4", None, "12", None])
    trainer = AsyncGRPOTrainer(
        model=str(spec_server.model_path),
        reward_funcs=[math_reward_func, coding_reward_func, format_reward_func, reward_func],
        args=spec_args(spec_server, tmp_path, max_steps=-1, num_train_epochs=1),
        train_dataset=dataset,
    )
    run = record_run(trainer)

    rewards = run.values("reward")
    math, code = run.values("rewards/math_reward_func/mean"), run.values("rewards/coding_reward_func/mean")
    # The worker runs ahead of the trainer, so it may score more than the epoch's 4 groups.
    assert len(rewards) >= 4 * 4 and len(rewards) % 4 == 0
    assert len(math) + len(code) == len(rewards)  # one of the two applies, None elsewhere
    assert math and code and len(math) % 4 == len(code) % 4 == 0
    assert set(math + code) <= {-1.0, 1.0}
    formatted, boxed = run.values("rewards/format_reward_func/mean"), run.values("rewards/reward_func/mean")
    assert len(formatted) == len(boxed) == len(rewards) and set(formatted + boxed) <= {0.0, 1.0}
    assert sum(rewards) == pytest.approx(sum(math) + sum(code) + sum(formatted) + sum(boxed))
    assert not run.values("rollout/reward_error_count")
    assert {n.reason for n in run.notices} <= {"zero_std"}
    assert trainer.ledger.frontier >= 4  # the epoch ends the run, kept groups or not
