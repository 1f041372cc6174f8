"""The spec's code examples run through `AsyncGRPOTrainer` against the real vLLM server.

Only the import line (`trl` -> `grpo_agent`), the model (the local tiny model), the server URL,
the dataset and the sizes change (`spec_harness.spec_args`: 4 rollouts of 16 tokens, 1 step).
The 21 code blocks of the spec (numbered as in reviews/spec-audit-2026-12-01.md), by line:

E1  29-42    quick start script           test_quick_start; tests/e2e/test_quickstart.py
E2  46-54    `vllm serve` (NCCL) + launch  GPU only: CPU tests serve with the gloo engine (tests/conftest.py)
E3  267-272  max_concurrent_rollouts=64   test_sampling_config_examples
E4  370-383  top_p=0.95, top_k=512        test_sampling_config_examples (CPU: fallback warning)
E5  391-405  LoRA (peft_config)           test_lora_example; tests/e2e/test_lora_sync.py
E6  409-416  LoRA server flags            tests/e2e/test_lora_sync.py (lora_server fixture)
E7  457-467  example 1 + doctest          test_reward_examples.py::test_example_1_doctest,
                                          ::test_mixed_sync_and_async_reward_functions_are_summed
E8  473-493  example 2 + doctest          ::test_example_2_doctest, ::test_examples_2_3_and_4_...
E9  499-520  example 3 + doctest          ::test_example_3_doctest, ::test_examples_2_3_and_4_...
E10 526-575  example 4 (task, None)       ::test_examples_2_3_and_4_score_every_rollout_they_apply_to
E11 587-593  example 5 (async)            ::test_mixed_sync_and_async_reward_functions_are_summed
E12 599-613  reward_funcs, mixed list     ::test_mixed_sync_and_async_reward_functions_are_summed
E13 630-658  CurriculumTrainer, loop_cls  test_curriculum_trainer_skips_the_prompts_it_solved
             (and its docstring, 963-964)
E14 679-684  tools=[tool1, tool2]         test_agent_examples.py::test_sync_and_async_tools_are_called
E15 696-727  tools=[multiply, async_add]  test_agent_examples.py::test_sync_and_async_tools_are_called
E16 735-769  IncrementEnv, self-sampled   tests/agent/test_agent_vllm.py::test_spec_increment_env_...;
                                          test_agent_examples.py::test_format_reward_beside_...
E17 784-813  IncrementEnv, dataset column test_agent_examples.py::test_increment_env_reads_..._column
E18 819-827  format_reward + environment  test_agent_examples.py::test_format_reward_beside_the_..._reward
E19 833-881  multiple environments        tests/agent/test_agent_vllm.py::test_spec_multi_environment_...
E20 946-957  trainer docstring example    test_quick_start (the same code with another model id)
E21 332-349  tree-packing worked example  tests/train/test_packing.py::test_spec_five_step_example

The trainer paths the examples leave out (weight_sync_steps, gradient_accumulation_steps and
logging_steps > 1, log_completions) are in test_trainer_paths.py.
"""
from __future__ import annotations

import pytest
from datasets import Dataset
from spec_harness import record_run, served_weight_version, spec_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def deepmath_like() -> Dataset:
    """Two rows with DeepMath-103K's columns (conversational `prompt`, `solution`)."""
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}? Put the answer in \\boxed{{}}."}],
         "solution": str(2 * a)}
        for a in (3, 7)
    ])


def check_accuracy_scored_every_rollout(run, num_prompts: int) -> None:
    """accuracy_reward scored every rollout in the worker (none raised), and the run ended
    once its epoch of prompts was consumed. A random tiny model never writes the right
    `\\boxed{}` answer, so every group has equal rewards and is dropped: that is the spec's
    rule, not a failure (the other examples show kept groups being trained). One epoch: the
    spec's default 3 would repeat the same dropped groups."""
    accuracy, rewards = run.values("rewards/accuracy_reward/mean"), run.values("reward")
    assert accuracy and len(accuracy) == len(rewards) and len(rewards) % 4 == 0
    assert set(accuracy) <= {0.0, 1.0}
    assert not run.values("rollout/reward_error_count")
    assert {notice.reason for notice in run.notices} <= {"zero_std"}
    assert run.trainer.ledger.frontier >= num_prompts


def test_quick_start(spec_server, tmp_path):
    """Spec lines 29-42 (and the trainer docstring's example, 946-957)."""
    from grpo_agent import AsyncGRPOTrainer
    from grpo_agent.rewards import accuracy_reward

    dataset = deepmath_like()

    trainer = AsyncGRPOTrainer(
        model=str(spec_server.model_path),
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
        args=spec_args(spec_server, tmp_path, max_steps=-1, num_train_epochs=1),
    )
    run = record_run(trainer)
    check_accuracy_scored_every_rollout(run, len(dataset))


def test_lora_example(spec_server, tmp_path):
    """Spec lines 391-405: a rank-32 LoRA adapter on every linear layer is trained; the server
    has no --enable-lora, so the merged weights are pushed (the spec's fallback)."""
    import torch
    from grpo_agent import AsyncGRPOTrainer
    from grpo_agent.rewards import accuracy_reward
    from peft import LoraConfig

    dataset = deepmath_like()

    trainer = AsyncGRPOTrainer(
        model=str(spec_server.model_path),
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
        peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"),
        args=spec_args(spec_server, tmp_path, max_steps=-1, num_train_epochs=1),
    )
    modules = dict(trainer.model.named_modules())
    adapted = [name for name, module in modules.items() if hasattr(module, "lora_A")]
    plain = [name for name, module in modules.items() if isinstance(module, torch.nn.Linear)
             and "lora_" not in name and not name.endswith(".base_layer")]
    assert adapted and [name.rsplit(".", 1)[-1] for name in plain] == ["lm_head"]  # all-linear
    assert {modules[name].r["default"] for name in adapted} == {32}
    trainable = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)  # the base model is frozen
    run = record_run(trainer)

    check_accuracy_scored_every_rollout(run, len(dataset))
    assert run.values("perf/weight_sync_transfer_s")  # merged weights went to the server
    assert served_weight_version(spec_server.base_url) == str(trainer.model_version)


def test_curriculum_trainer_skips_the_prompts_it_solved(spec_server, tmp_path):
    """Spec lines 630-658: `CurriculumTrainer` with `loop_cls = CurriculumRolloutLoop` and a
    `CurriculumConfig` field. The easy prompt, once solved by every rollout, is filtered in the
    next epochs (counted as consumed); the hard one keeps being rolled out and trained."""
    from spec_examples.curriculum import CurriculumConfig, CurriculumTrainer, easy_or_rare_reward

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "an easy one"}],
                                            [{"role": "user", "content": "a hard one"}]]})
    # The worker dispatches prompts ahead of scoring, so the first epochs see no pass rate yet.
    args = spec_args(spec_server, tmp_path, CurriculumConfig, max_steps=-1, num_train_epochs=12,
                     pass_rate_cap=0.9)
    trainer = CurriculumTrainer(
        model=str(spec_server.model_path), reward_funcs=easy_or_rare_reward, args=args,
        train_dataset=dataset,
    )
    run = record_run(trainer)

    filtered = [notice.row_index for notice in run.notices if notice.reason == "filtered"]
    assert filtered and set(filtered) == {0}, run.notices  # only the solved (easy) prompt
    assert trainer.ledger.frontier >= 12 * len(dataset)  # filtered prompts count as consumed
    assert {sample.row_index for sample in run.trained} <= {1}


def test_sampling_config_examples(spec_server, tmp_path, capfd):
    """Spec lines 267-272 and 377-383: `max_concurrent_rollouts=64` caps the rollouts in flight;
    `top_p=0.95, top_k=512` samples from the truncated set. A CPU server cannot return the
    candidate sets (no --return-sampling-mask), so the worker warns that the trainer keeps the
    full vocabulary, and the ratios show that bias (trainer log-prob below the sampler's)."""
    from grpo_agent import AsyncGRPOTrainer
    from spec_examples.reward_length import reward_func

    training_args = spec_args(spec_server, tmp_path, max_concurrent_rollouts=64, top_p=0.95, top_k=512)
    trainer = AsyncGRPOTrainer(
        model=str(spec_server.model_path), reward_funcs=reward_func, args=training_args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "The sky is"}],
                                                    [{"role": "user", "content": "The sun is"}]]}),
    )
    run = record_run(trainer)

    assert "cannot return sampling masks" in capfd.readouterr().err
    assert run.trained and trainer.state.global_step == 1
    assert max(run.values("rollout/concurrency_cap")) <= 64
    assert max(run.values("rollout/concurrency")) <= 64
    # Same weights in float32: without truncation the ratios are 1 (see the mixed-list test).
    assert max(run.values("sampling/importance_sampling_ratio/max")) < 0.999
