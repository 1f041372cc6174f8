"""AsyncGRPOConfig carries the spec's defaults and rejects bad combinations with a fix."""
import math
from pathlib import Path

import pytest
from grpo_agent import AsyncGRPOConfig


def test_spec_defaults(tmp_path):
    c = AsyncGRPOConfig(output_dir=str(tmp_path))
    assert c.learning_rate == 1e-6
    assert str(c.lr_scheduler_type.value) == "constant"
    assert c.logging_steps == 1
    assert c.gradient_checkpointing is True
    assert c.ignore_data_skip is True and c.remove_unused_columns is False
    assert (c.num_generations, c.max_completion_length, c.temperature) == (8, 2048, 1.0)
    assert (c.top_p, c.top_k, c.min_p) == (1.0, 0, None)
    assert c.vllm_server_base_url == "http://localhost:8000" and c.vllm_server_timeout == 1800.0
    assert (c.epsilon, c.epsilon_high, c.effective_epsilon_high) == (0.2, None, 0.2)
    assert c.score_centering is True
    assert (c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max) == (0.5, 5.0)
    assert (c.num_sampler_logprobs, c.token_budget) == (8, None)
    assert (c.max_concurrent_rollouts, c.max_staleness, c.weight_sync_steps) == (512, 4, 1)
    assert c.rollout_worker_timeout == 300.0
    assert c.dtype == "float32"
    assert c.logging_nan_inf_filter is True


def test_bf16_default_falls_back_without_a_gpu_instead_of_failing(tmp_path):
    c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert c.bf16 is False
    assert AsyncGRPOConfig(output_dir=str(tmp_path), fp16=False, bf16=False).bf16 is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_generations": 1}, "num_generations >= 2"),
        ({"top_p": 0.9}, (r"^top_p < 1 or min_p > 0 requires top_k > 0: vLLM uses top_k to bound the "
                          r"sampling candidate set\. Set top_k \(e\.g\. 512\)\.$")),
        ({"min_p": 0.1}, "requires top_k > 0"),
        ({"ignore_data_skip": False}, (r"^ignore_data_skip must be True: resume restores the rollout position "
                                       r"from rollout_state.json")),
        ({"remove_unused_columns": True}, (r"^remove_unused_columns must be False: every dataset column is "
                                           r"passed to the reward functions")),
        ({"dtype": "fp8"}, r"^dtype='fp8': choose one of auto, bfloat16, float16, float32\.$"),
        ({"vllm_importance_sampling_clip_min": 6.0},
         r"^vllm_importance_sampling_clip_min=6.0 must be below vllm_importance_sampling_clip_max=5.0\.$"),
        ({"top_p": 0.0, "top_k": 50}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": -0.5, "top_k": 50}, r"top_p=-0.5 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"top_p": 1.001, "top_k": 50}, r"top_p=1.001 must be in \(0, 1\]"),
        ({"max_staleness": -1}, r"^max_staleness=-1 is out of range: set max_staleness >= 0 \(0 = on-policy\)\.$"),
        ({"tool_timeout_s": 0}, r"^tool_timeout_s=0 is out of range: set tool_timeout_s > 0 \(seconds per tool call\)"),
        ({"tool_timeout_s": -5.0}, r"^tool_timeout_s=-5.0 is out of range: set tool_timeout_s > 0"),
        ({"cuda_graphs": True, "gradient_checkpointing": True}, "needs gradient_checkpointing=False"),
    ],
)
def test_bad_combinations_name_the_rule_and_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(output_dir=str(tmp_path), **kwargs)


def test_the_boundaries_of_the_refused_ranges_are_accepted(tmp_path):
    """The edges of the checks above are valid settings: top_p 1 (no truncation), max_staleness
    0 (on-policy), a tiny tool timeout, and cuda_graphs once gradient checkpointing is off."""
    c = AsyncGRPOConfig(output_dir=str(tmp_path), top_p=1.0, max_staleness=0, tool_timeout_s=0.001)
    assert (c.top_p, c.max_staleness, c.tool_timeout_s) == (1.0, 0, 0.001)
    assert AsyncGRPOConfig(output_dir=str(tmp_path), top_p=0.5, top_k=50).top_p == 0.5
    c = AsyncGRPOConfig(output_dir=str(tmp_path), cuda_graphs=True, gradient_checkpointing=False)
    assert c.cuda_graphs is True and c.gradient_checkpointing is False
    c = AsyncGRPOConfig(output_dir=str(tmp_path), temperature=2.0, eval_temperature=2.0)
    assert (c.temperature, c.eval_temperature) == (2.0, 2.0)
    c = AsyncGRPOConfig(output_dir=str(tmp_path), temperature=0.0, max_completion_length=1,
                        token_budget=1, epsilon=0.0, epsilon_high=0.0)
    assert (c.temperature, c.max_completion_length, c.token_budget, c.epsilon) == (0.0, 1, 1, 0.0)
    c = AsyncGRPOConfig(output_dir=str(tmp_path), top_k=0, max_tool_calling_iterations=0, min_p=0.0)
    assert (c.top_k, c.max_tool_calling_iterations, c.min_p) == (0, 0, 0.0)
    c = AsyncGRPOConfig(output_dir=str(tmp_path), num_sampler_logprobs=0, router_aux_loss_coef=0.0,
                        num_completions_to_print=0)
    assert (c.num_sampler_logprobs, c.router_aux_loss_coef, c.num_completions_to_print) == (0, 0.0, 0)
    assert AsyncGRPOConfig(output_dir=str(tmp_path), top_k=1, min_p=1.0).min_p == 1.0
    for report_to in ("none", "all", "tensorboard", ["wandb", "tensorboard"]):
        assert AsyncGRPOConfig(output_dir=str(tmp_path), report_to=report_to).output_dir == str(tmp_path)
    c = AsyncGRPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=10)
    assert c.eval_steps == 10
    c = AsyncGRPOConfig(output_dir=str(tmp_path), learning_rate=0.0, num_train_epochs=0, max_steps=3)
    assert (c.learning_rate, c.num_train_epochs, c.max_steps) == (0.0, 0, 3)


def test_docs_config_md_is_current():
    from pathlib import Path

    from grpo_agent.config import config_reference_markdown

    doc = Path(__file__).parents[2] / "docs" / "config.md"
    assert doc.read_text() == config_reference_markdown(), (
        "docs/config.md is stale: run `python -m grpo_agent.config > docs/config.md`"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 2.0}, "must be below"),
        ({"weight_sync_steps": 0}, r"^weight_sync_steps=0 is out of range: set weight_sync_steps >= 1 \(optimizer"),
        ({"max_concurrent_rollouts": 0}, r"^max_concurrent_rollouts=0 is out of range: set max_concurrent_rollouts >= 1"),
        ({"no_progress_timeout": -1.0}, r"^no_progress_timeout=-1.0 is out of range: set no_progress_timeout >= 0 \(0 = never\)"),
        ({"cuda_graphs": True, "gradient_checkpointing": False, "fp16": True},
         r"^cuda_graphs=True does not run with fp16: .* Use bf16 or turn cuda_graphs off\.$"),
        ({"temperature": -1.0}, r"temperature=-1.0 is out of range: set temperature >= 0"),
        ({"eval_temperature": -0.5}, r"set eval_temperature >= 0"),
        # vLLM (0.32) refuses every request above 2: the run failed at its first request.
        ({"temperature": 2.5}, (r"^temperature=2.5 is out of range: set temperature <= 2 \(vLLM "
                                r"refuses every request above it\).$")),
        ({"eval_temperature": 3.0}, r"^eval_temperature=3.0 is out of range: set eval_temperature <= 2"),
        ({"max_completion_length": 0}, r"set max_completion_length >= 1"),
        ({"token_budget": 0}, r"set token_budget >= 1 \(null = the server's max_model_len\)"),
        ({"epsilon": -0.1}, r"set epsilon >= 0"),
        ({"epsilon_high": -0.1}, r"set epsilon_high >= 0"),
        ({"repetition_penalty": 0.0}, r"set repetition_penalty > 0"),
        ({"vllm_server_timeout": 0.0}, r"set vllm_server_timeout > 0"),
        ({"rollout_worker_timeout": -1.0}, r"set rollout_worker_timeout > 0"),
        ({"top_k": -5}, r"top_k=-5 is out of range: set top_k >= 0 \(0 = no top-k\)"),
        ({"top_k": -1}, r"set top_k >= 0 \(0 = no top-k\)"),  # vLLM's "off", not the spec's
        ({"max_tool_calling_iterations": -1},
         r"set max_tool_calling_iterations >= 0 \(null = no cap, 0 = no tool call is run\)"),
        ({"min_p": 1.5, "top_k": 50}, r"min_p=1.5 must be in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p=-0.1 must be in \[0, 1\]"),
        ({"num_sampler_logprobs": -1}, r"set num_sampler_logprobs >= 0 \(top log-probs per token\)"),
        ({"router_aux_loss_coef": -0.01}, r"set router_aux_loss_coef >= 0 \(null = the model"),
        ({"num_completions_to_print": -1}, r"set num_completions_to_print >= 0 \(null = all\)"),
        # torch refused it only once the server and model were up ("Invalid learning rate: -1")
        ({"learning_rate": -1.0}, r"^learning_rate=-1.0 is out of range: set learning_rate >= 0 \(0 = no"),
        # failed once the server was up, naming no field ("bogus is not supported, only ...")
        # NaN (`--set epsilon=NaN`, TOML `nan`) failed every `value < low` test: accepted into the loss,
        # or "cannot convert float NaN to integer" naming no field for the timeouts
        ({"epsilon": math.nan}, r"^epsilon=nan is out of range: set epsilon >= 0 \(the lower clip\)\.$"),
        ({"learning_rate": math.nan}, r"^learning_rate=nan is out of range: set learning_rate >= 0"),
        ({"rollout_worker_timeout": math.nan}, r"^rollout_worker_timeout=nan is out of range: set rollout_"),
        ({"tool_timeout_s": math.nan}, r"^tool_timeout_s=nan is out of range: set tool_timeout_s > 0"),
        ({"no_progress_timeout": math.nan}, r"^no_progress_timeout=nan is out of range: set no_progress_timeout >= 0"),
        ({"vllm_importance_sampling_clip_max": math.nan},
         r"^vllm_importance_sampling_clip_min=0.5 must be below vllm_importance_sampling_clip_max=nan\.$"),
        ({"report_to": "bogus"}, (r"^report_to='bogus': 'bogus' is no integration transformers "
                                  r"knows. Use none, all or some of azure_ml, ")),
        ({"report_to": "wandb,bogus"}, (r"^report_to=\['wandb', 'bogus'\]: 'bogus' is no integration"
                                        r".*comma-separated: --set report_to=wandb,tensorboard\)")),
        # transformers' default eval_strategy='no' ignores eval_steps: no evaluation, silently
        ({"eval_steps": 10}, (r"^eval_steps=10 is set but eval_strategy='no', so the run never "
                              r"evaluates every eval_steps. Add eval_strategy=steps \(--set eval_strategy=steps\), "
                              r"or remove eval_steps\.$")),
        # the run "finished" after one empty step, its model untrained
        ({"num_train_epochs": 0}, (r"^num_train_epochs=0 and max_steps is not set: the run would "
                                   r"train nothing. Set num_train_epochs > 0 .*, or set max_steps\.$")),
    ],
)
def test_more_bad_settings_name_the_rule_and_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16", "float32"])
def test_every_documented_dtype_and_the_never_stopping_no_progress_timeout_are_accepted(tmp_path, dtype):
    c = AsyncGRPOConfig(output_dir=str(tmp_path), dtype=dtype, no_progress_timeout=0, num_generations=2,
                        weight_sync_steps=1, max_concurrent_rollouts=1)
    assert (c.dtype, c.no_progress_timeout, c.num_generations) == (dtype, 0, 2)


def test_a_multi_process_launch_without_a_gpu_is_detected_for_use_cpu(monkeypatch):
    """Without use_cpu every torchrun rank on a CPU box would count itself the main process."""
    import torch
    from grpo_agent.config import _launched_on_cpu_with_several_processes as launched

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not launched()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not launched()


def test_prompt_filters_given_as_text_are_comma_separated_names_not_letters(tmp_path):
    # `--set prompt_filters=curriculum` reaches the config as text; list("curriculum") would be
    # letters, each an "Unknown prompt filter 'c'" once the rollout worker resolves them.
    assert AsyncGRPOConfig(output_dir=str(tmp_path), prompt_filters="curriculum").prompt_filters == ["curriculum"]
    assert AsyncGRPOConfig(output_dir=str(tmp_path), prompt_filters="a, b").prompt_filters == ["a", "b"]
    assert AsyncGRPOConfig(output_dir=str(tmp_path), prompt_filters=["a"]).prompt_filters == ["a"]


@pytest.mark.parametrize("kind", ["logging", "eval", "save"])
def test_a_fraction_of_max_steps_without_max_steps_is_refused_and_with_it_kept(tmp_path, kind):
    # Without max_steps the Trainer sees 10**9 steps: logging_steps=0.5 logged no window and
    # save_steps=0.5 saved no checkpoint in a whole run (measured: `train --env words
    # --set num_train_epochs=0.05 --set logging_steps=0.5` wrote no training row).
    kwargs = {f"{kind}_strategy": "steps", f"{kind}_steps": 0.5}
    with pytest.raises(ValueError, match=rf"^{kind}_steps=0.5 is a fraction of max_steps, but "
                                         rf"max_steps is not set.*Set {kind}_steps to a number"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=10, **kwargs)
    assert getattr(c, f"{kind}_steps") == 0.5
    c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{**kwargs, f"{kind}_steps": 2})
    assert getattr(c, f"{kind}_steps") == 2
    with pytest.raises(ValueError, match="max_steps is not set"):  # 0 is unset, as in transformers
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=0, **kwargs)
    # under the epoch strategy the steps value is unused, so no fraction of anything
    c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{**kwargs, f"{kind}_strategy": "epoch"})
    assert getattr(c, f"{kind}_steps") == 0.5


def test_the_trainer_sees_a_run_as_one_epoch_as_docs_config_md_says(tmp_path):
    """docs/config.md: `*_strategy="epoch"` acts once, after the run's last step, because the
    Trainer's epoch loop runs once (measured: save_strategy=epoch wrote one checkpoint, at the
    end); the run's prompt epochs are counted by the trainer itself."""
    from types import SimpleNamespace

    from grpo_agent.train.trainer import UNKNOWN_STEPS, AsyncGRPOTrainer

    stub = SimpleNamespace(get_total_train_batch_size=lambda args: 8)
    for config, steps in ((AsyncGRPOConfig(output_dir=str(tmp_path), num_train_epochs=2), UNKNOWN_STEPS),
                          (AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=5), 5)):
        epochs, per_epoch, *_, max_steps = AsyncGRPOTrainer.set_initial_training_values(stub, config, None)
        assert (epochs, per_epoch, max_steps) == (1, steps, steps)
    assert "`save_strategy` `\"epoch\"` act once, after the run's last step" in (
        Path(__file__).parents[2] / "docs" / "config.md").read_text().replace("\n", " ")


@pytest.mark.parametrize("save_steps", [0, -1])
def test_save_steps_that_never_save_are_refused(tmp_path, save_steps):
    # transformers saves only `if save_steps > 0`: save_steps=0 ran a whole run without a
    # checkpoint, and the config and --dry-run accepted it.
    with pytest.raises(ValueError, match=rf"^save_steps={save_steps} with save_strategy='steps' "
                                         r"never saves a checkpoint\. Set save_steps"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, save_steps=save_steps)
    c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, save_steps=save_steps,
                        save_strategy="no")
    assert c.save_steps == save_steps


@pytest.mark.parametrize(("kind", "steps", "why"), [
    # transformers reads eval_steps=0 as unset: the run evaluated every logging_steps, silently
    ("eval", 0, r" \(transformers would evaluate every logging_steps instead\)"),
    # a negative interval counted steps modulo it: -1 with max_steps=10 acted at step 10 only
    ("eval", -1, r" \(transformers would act on steps modulo a negative number\)"),
    ("logging", -1, r" \(transformers would act on steps modulo a negative number\)"),
])
def test_eval_and_logging_steps_that_are_no_interval_are_refused(tmp_path, kind, steps, why):
    with pytest.raises(ValueError, match=(
            rf"^{kind}_steps={steps} with {kind}_strategy='steps' is no interval{why}\. Set "
            rf"{kind}_steps to a number of steps \(>= 1\) or, with max_steps set, a fraction of "
            r"it below 1")):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=10,
                        **{f"{kind}_strategy": "steps", f"{kind}_steps": steps})
    unset = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, eval_strategy="steps",
                            logging_steps=3)
    assert unset.eval_steps == 3  # unset: every logging_steps, as docs/evaluation.md says


def test_report_to_given_as_text_is_comma_separated_names(tmp_path):
    # `--set report_to=wandb,tensorboard` was refused as one unknown integration (55f2947);
    # prompt_filters took the same text as a list.
    c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="tensorboard, wandb")
    assert c.report_to == ["tensorboard", "wandb"]
    assert AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True,
                           report_to="tensorboard").report_to == ["tensorboard"]


@pytest.mark.parametrize("kwargs", [{"vllm_server_timeout": math.inf},
                                    {"stall_timeouts": {"collective": math.inf}},
                                    {"vllm_server_timeout": 1e20}])  # OverflowError in timedelta
def test_an_infinite_timeout_behind_the_process_group_timeout_is_refused(tmp_path, kwargs):
    # ddp_timeout is derived from them: `--set vllm_server_timeout=Infinity` failed as an
    # OverflowError traceback ("cannot convert float infinity to integer"), naming no field.
    with pytest.raises(ValueError, match=r"^vllm_server_timeout=.* the process group's timeout "
                                         r"\(ddp_timeout\) is derived from these.* Set each to a finite"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    # a stage outside the collective phases may wait forever
    c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, stall_timeouts={"scoring": math.inf})
    assert c.stall_timeouts == {"scoring": math.inf}


def test_a_nan_eval_success_threshold_is_refused(tmp_path):
    # no reward reaches NaN: every evaluation rollout counted as failed, without a word
    with pytest.raises(ValueError, match=r"^eval_success_threshold=nan: no reward reaches it.*"
                                         r"or null for the env's declared success_threshold"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, eval_success_threshold=math.nan)
    assert AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True,
                           eval_success_threshold=-1.5).eval_success_threshold == -1.5


@pytest.mark.parametrize(("report_to", "message"), [
    (["none", "wandb"], (r"^report_to=\['none', 'wandb'\]: 'none' stands alone, not among other "
                         r"integrations\. Use none by itself, or list only integrations")),
    ("tensorboard,all", r"^report_to=\['tensorboard', 'all'\]: 'all' stands alone"),
    (None, r"^report_to=None is no setting: .* Use none \(no reporting\), all, or integration names"),
])
def test_report_to_values_the_trainer_would_refuse_are_refused(tmp_path, report_to, message):
    # transformers reads none and all only alone, and None as [None]: it kept them, and building
    # the Trainer (server up, model loaded) failed with "none is not supported, only azure_ml, ..."
    # (or "None is not supported"), naming no field.
    from transformers.integrations import get_reporting_integration_callbacks

    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=report_to)
    for accepted in ("none", ["none"], "all", ["tensorboard"], "tensorboard,wandb"):
        c = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=accepted)
        get_reporting_integration_callbacks(c.report_to)  # what the Trainer calls: no error
