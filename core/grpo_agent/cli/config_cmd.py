"""`grpo-agent config show`: the resolved `AsyncGRPOConfig` as JSON."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Show the resolved training configuration.", no_args_is_help=True)


@app.callback()
def config() -> None:
    """Show the resolved training configuration."""


@app.command("show")
def show(
    config_file: Annotated[
        Path | None, typer.Option("--config", help="Run file (.toml or .yaml).")
    ] = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field: key=value (repeatable).")
    ] = None,
) -> None:
    """Print the config a run would use (run file, then --set overrides) as JSON.

    Example: grpo-agent config show --config run.toml --set max_steps=10
    """
    from grpo_agent.cli.config_files import build_config

    typer.echo(build_config(config_file, sets or []).to_json_string())
