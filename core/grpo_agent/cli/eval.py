"""`grpo-agent eval --env NAME --model PATH`: evaluate a saved model on an env's eval split.

Thin: flags become an `AsyncGRPOConfig` (its eval_* fields) and go to
`grpo_agent.train.eval_run.run_eval` (torch, transformers and vLLM load only there).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grpo_agent.cli.errors import CLI_ERRORS, CliError


def evaluate(
    env: Annotated[str, typer.Option("--env", help="Registered environment name (see `env list`).")],
    model: Annotated[
        str | None,
        typer.Option("--model", help="Model or checkpoint folder, or hub id (default: the tiny test model)."),
    ] = None,
    vllm_url: Annotated[
        str | None,
        typer.Option("--vllm-url", help="Running vLLM server serving --model (default: start one here)."),
    ] = None,
    num_generations: Annotated[
        int | None,
        typer.Option("--num-generations", min=1,
                     help="Rollouts per row: pass@1 and pass@K (default: --set eval_num_generations, else 1)."),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature",
                     help="Sampling temperature, 0 to 2; 0 = greedy (default: --set eval_temperature, else 0)."),
    ] = None,
    env_args: Annotated[
        list[str] | None,
        typer.Option("--env-arg", help="Env option key=value (repeatable; `env show NAME` lists them)."),
    ] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option("--set", help="Config field key=value, e.g. max_completion_length=256 (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="JSON result file (default: eval-ENV.json here).")
    ] = None,
) -> None:
    """Evaluate a model on an environment's eval split: prints a table, writes JSON.

    The same rollouts as evaluation during training: the env's tool loop, reward functions and
    success threshold (eval_success_threshold overrides it), greedy unless --temperature. A model
    a run saved (OUTPUT_DIR/final) takes that run's rollout settings from OUTPUT_DIR/config.json.

    Example: grpo-agent eval --env reasoning-gym --env-arg task=leg_counting --model runs/x/final
    """
    from grpo_agent.cli.config_files import build_config
    from grpo_agent.plugins.options import parse_pairs

    if temperature is not None:
        _check_temperature_flag(temperature)
    try:
        from grpo_agent.train.eval_run import print_report, run_eval, run_rollout_settings
    except ImportError as err:
        raise CliError(f"Evaluation is not available in this install ({err}).") from err
    run = run_rollout_settings(model)
    config = build_config(None, sets or [], base=run[1] if run else None,
                          eval_num_generations=num_generations, eval_temperature=temperature)
    if run:
        typer.echo(_run_settings_note(*run))
    try:
        report, path = run_eval(env, config, model=model, vllm_url=vllm_url,
                                env_args=parse_pairs(env_args or [], "--env-arg"), out_path=out)
    except CLI_ERRORS:
        raise
    except Exception as err:  # an unreachable --vllm-url or a server that failed to start: one line
        raise CliError(f"The evaluation failed: {type(err).__name__}: {err}") from err
    print_report(report, path)


def _check_temperature_flag(temperature: float) -> None:
    """The config's rule, naming the flag typed: its refusal names `eval_temperature`, the field
    the flag sets, which a user of `--temperature` never wrote."""
    from grpo_agent.sampling_limits import check_temperature

    try:
        check_temperature("--temperature", temperature)
    except ValueError as err:
        raise CliError(str(err)) from None


def _run_settings_note(path: Path, settings: dict) -> str:
    """Which rollout settings this evaluation takes from the run (those off their defaults)."""
    from dataclasses import MISSING, fields

    from grpo_agent.config import AsyncGRPOConfig

    defaults = {f.name: f.default_factory() if f.default is MISSING else f.default
                for f in fields(AsyncGRPOConfig) if f.name in settings}
    changed = [f"{key}={value!r}" for key, value in settings.items() if value != defaults[key]]
    return (f"Rollout settings from the run that saved this model ({path}), as its own "
            f"evaluations used them: {', '.join(changed) or 'all defaults'}; --set overrides any.")
