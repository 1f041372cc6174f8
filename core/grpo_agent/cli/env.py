"""`grpo-agent env list | show NAME | check NAME`: inspect registered environments."""
from __future__ import annotations

import json
from typing import Annotated

import typer

from grpo_agent.cli.errors import CliError

app = typer.Typer(help="Inspect and check registered environments.", no_args_is_help=True)

EnvArgs = Annotated[
    list[str] | None,
    typer.Option("--env-arg", help="Env option key=value (repeatable), as for `train`."),
]


def _spec(registry, name: str, env_args: list[str] | None):
    from grpo_agent.plugins.options import parse_pairs

    return registry.environment_spec(name, parse_pairs(env_args or [], "--env-arg"))


@app.callback()
def env() -> None:
    """Inspect and check registered environments."""


@app.command("list")
def list_envs() -> None:
    """List environments: id, alias, distribution and description.

    Example: grpo-agent env list
    """
    from grpo_agent.plugins import load_registry

    registry = load_registry()
    aliases = {target: alias for alias, target in registry.aliases.items()}
    for env_id, spec in sorted(registry.environments.items()):
        alias = f" (alias {aliases[env_id]})" if env_id in aliases else ""
        typer.echo(f"{env_id}{alias}  [{spec.distribution}]  {spec.description}")


@app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="Environment name, id or module:Class.")],
    env_args: EnvArgs = None,
) -> None:
    """Show an environment's options, tool schemas, reward sources, dataset and eval split.

    Example: grpo-agent env show reasoning-gym --env-arg task=countdown
    """
    from grpo_agent.plugins import load_registry

    spec = _spec(load_registry(), name, env_args)
    typer.echo(f"{spec.id}  [{spec.distribution}]  {spec.factory.__module__}:{spec.factory.__qualname__}")
    typer.echo(f"description: {spec.description}")
    typer.echo("options (--env-arg key=value):" if spec.options else "options: (none)")
    for option in spec.options:
        typer.echo(f"  {option.summary()}  [now {spec.option_values[option.name]!r}]")
        allowed = option.allowed()
        if allowed is not None:
            typer.echo(f"    choices: {', '.join(map(str, allowed))}")
    sources = [r if isinstance(r, str) else getattr(r, "__name__", repr(r)) for r in spec.rewards]
    if callable(getattr(spec.factory, "get_reward", None)):
        sources.append("get_reward (env)")
    typer.echo(f"reward sources: {', '.join(sources) or '(none)'}")
    dataset = spec.load_dataset()
    if dataset is None:
        typer.echo("dataset: none (reset() samples its own tasks; set max_steps)")
    else:
        typer.echo(f"dataset: {len(dataset)} rows, columns: {', '.join(dataset.column_names)}")
    typer.echo(_eval_split_line(spec))
    typer.echo("tools:")
    for schema in spec.tool_schemas():
        typer.echo(json.dumps(schema, indent=2))


def _eval_split_line(spec) -> str:
    """Whether `grpo-agent eval` and a run's eval_strategy can use this env (the refusal of
    an env without a split sends users here)."""
    from grpo_agent.rollout.evaluation import DEFAULT_SUCCESS_THRESHOLD

    split = spec.load_eval_dataset()
    if split is None:
        return "eval split: none (grpo-agent eval and --set eval_strategy need one; docs/evaluation.md)"
    threshold = DEFAULT_SUCCESS_THRESHOLD if spec.success_threshold is None else spec.success_threshold
    return f"eval split: {len(split)} rows, a rollout passes at summed reward >= {threshold:g}"


@app.command("check")
def check(
    name: Annotated[str, typer.Argument(help="Environment name, id or module:Class.")],
    rows: Annotated[int, typer.Option("--rows", min=1, help="Sample rows to reset on.")] = 2,
    env_args: EnvArgs = None,
) -> None:
    """Instantiate the env, reset it on sample rows, call its tools, score its gold answer.

    Example: grpo-agent env check math
    """
    from grpo_agent.plugins import load_registry
    from grpo_agent.plugins.check import check_environment

    registry = load_registry()
    steps = check_environment(_spec(registry, name, env_args), registry, num_rows=rows)
    for step in steps:
        typer.echo(f"{'ok ' if step.ok else 'FAIL'} {step.name}: {step.detail}")
    failed = [step.name for step in steps if not step.ok]
    if failed:
        raise CliError(f"env check {name}: {len(failed)} step(s) failed: {', '.join(failed)}")
    typer.echo(f"env check {name}: all {len(steps)} steps passed")
