"""`grpo-agent train --env NAME`: parse flags into `AsyncGRPOConfig`, then run training.

The command is thin: it builds the config and hands it to `grpo_agent.train.run.run_training`
(imported lazily; the trainer, vLLM and torch load only here).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grpo_agent.cli.errors import CliError


def train(
    env: Annotated[str, typer.Option("--env", help="Registered environment name (see `env list`).")],
    config_file: Annotated[
        Path | None, typer.Option("--config", help="Run file (.toml or .yaml).")
    ] = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config field: key=value (repeatable).")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model id or folder (default: the tiny test model).")
    ] = None,
    vllm_url: Annotated[
        str | None, typer.Option("--vllm-url", help="Running vLLM server (default: start one here).")
    ] = None,
    output_dir: Annotated[
        str | None, typer.Option("--output-dir", help="Where checkpoints and metrics go.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Resolve env and config, print them, do not train.")
    ] = False,
) -> None:
    """Train on a registered environment.

    Example: grpo-agent train --env counter --set max_steps=20 --output-dir runs/counter
    """
    from grpo_agent.cli.config_files import build_config
    from grpo_agent.plugins import load_registry

    config = build_config(config_file, sets or [], output_dir=output_dir)
    spec = load_registry().environment_spec(env)
    if dry_run:
        typer.echo(f"env: {spec.id} [{spec.distribution}]")
        typer.echo(f"model: {model or '(tiny test model)'}  vllm: {vllm_url or '(managed here)'}")
        typer.echo(config.to_json_string())
        return
    try:
        from grpo_agent.train.run import run_training
    except ImportError as err:
        raise CliError(f"Training is not available in this install ({err}).") from err
    out = run_training(env=env, config=config, model=model, vllm_url=vllm_url)
    typer.echo(f"Run finished: {out}")
