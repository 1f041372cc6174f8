"""`run_eval`: what `grpo-agent eval --env NAME --model PATH` does after parsing its flags.

Design decision: the same evaluation as during training (`grpo_agent.rollout.evaluation`: the
training tool loop, the env, its reward functions and success threshold, greedy by default),
on a saved model or checkpoint folder instead of the trainer's live weights. Embedded by
default, like `train`: without `--vllm-url` a managed vLLM server is started for the model and
stopped (by PID) when the evaluation ends.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from grpo_agent.config import AsyncGRPOConfig

logger = logging.getLogger(__name__)


# The fields of a run's config.json that shape its rollouts and its evaluations. `grpo-agent
# eval` of a model the run saved starts from them, so it evaluates as the run's own evaluations
# did: the counter demo's model, trained with chat_template_kwargs={"enable_thinking": false},
# scored pass@1 0.44 that way and 0.00 under the default template.
RUN_ROLLOUT_FIELDS = (
    "chat_template_kwargs", "max_completion_length", "max_tool_calling_iterations", "top_p",
    "top_k", "min_p", "repetition_penalty", "tool_timeout_s", "plugin_args", "eval_temperature",
    "eval_num_generations", "per_device_eval_batch_size")


def run_rollout_settings(model: str | None) -> tuple[Path, dict[str, Any]] | None:
    """For a model a grpo-agent run saved (OUTPUT_DIR/final or OUTPUT_DIR/checkpoint-N): the
    run's config.json and its `RUN_ROLLOUT_FIELDS`; None for any other model."""
    from grpo_agent.train.run import run_config_of

    run = run_config_of(Path(model).parent) if model else None
    if run is None:
        return None
    return Path(model).parent / "config.json", {k: run[k] for k in RUN_ROLLOUT_FIELDS if k in run}


def check_model_folder(model: str) -> str:
    """A local folder must hold a full model; an adapter-only checkpoint cannot be served."""
    from grpo_agent.train.run import refuse_non_model_folder

    refuse_non_model_folder(model)
    folder = Path(model)
    if not folder.exists():
        return model  # a hub id: the server and the tokenizer resolve it
    if not folder.is_dir():
        raise ValueError(f"--model {model} is a file: pass the model's folder (config.json, "
                         "weights, tokenizer).")
    if not (folder / "config.json").is_file():
        hint = (" It holds a LoRA adapter only: merge it into its base model (peft "
                "merge_and_unload, then save_pretrained) and evaluate that folder."
                if (folder / "adapter_config.json").is_file() else "")
        raise ValueError(f"--model {model} has no config.json, so it is not a model folder.{hint}")
    return str(folder.resolve())


def run_eval(env: str, config: AsyncGRPOConfig, model: str | None = None,
             vllm_url: str | None = None, env_args: dict[str, Any] | None = None,
             out_path: str | Path | None = None) -> tuple[dict[str, Any], Path]:
    """Evaluate `model` on the env's eval split; returns the result (as JSON) and its path."""
    from transformers import AutoConfig, AutoTokenizer

    from grpo_agent.plugins import load_registry
    from grpo_agent.rollout.evaluation import (
        EvalSession,
        EvalSettings,
        dataset_rows,
        run_evaluation,
    )
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.sampler.server import MANAGED_DTYPE
    from grpo_agent.train.reporting import quiet_library_bars_off_terminal
    from grpo_agent.train.run import _server, _tiny_model_path
    from grpo_agent.train.setup import bf16_only_on_cpu

    quiet_library_bars_off_terminal()  # a hub model's tokenizer download, as in run_training
    registry = load_registry()
    spec = registry.environment_spec(env, env_args)
    split = spec.load_eval_dataset()
    if split is None:
        raise ValueError(
            f"Environment {spec.id!r} declares no eval split. Declare one with "
            "@environment(..., eval_dataset=...) in its package, or evaluate another env.")
    rows = dataset_rows(split)
    model_path = check_model_folder(model) if model else _tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    hybrid = bf16_only_on_cpu(AutoConfig.from_pretrained(model_path))
    settings = EvalSettings.from_config(config, spec.success_threshold)
    with _server(model_path, vllm_url, None, config) as base_url:
        config.vllm_server_base_url = base_url

        def session() -> EvalSession:
            return EvalSession(
                AsyncRolloutLoop, config=config, processing_class=tokenizer,
                reward_funcs=spec.reward_funcs(registry, config.plugin_args), settings=settings,
                environment_factory=spec.environment_factory, model_name=model_path,
                dtype=MANAGED_DTYPE, bf16_only_on_cpu=hybrid)  # as the managed server serves

        result = run_evaluation(session, rows, version=0)
    report = {"env": spec.id, "env_args": spec.option_values, "model": model_path,
              "vllm_url": vllm_url, "settings": vars(settings), **result.to_json()}
    path = Path(out_path or f"eval-{spec.name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report, path


def print_report(report: dict[str, Any], path: Path, examples: int = 3) -> None:
    """The metrics as a table, then a few rows (completion and reward), one line each even when
    piped (rich would wrap them at 80 columns off a terminal)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{report['env']} on {report['model']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report["metrics"].items():
        table.add_row(name, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    for row in report["rows"][:examples]:
        text = row["completions"][0].replace("\n", " ")[:160] if row["completions"] else ""
        console.print(f"row {row['row_index']}: rewards {row['rewards']} passed {row['passed']}: "
                      f"{text!r}", soft_wrap=True)
    console.print(f"Wrote {path}", soft_wrap=True)
