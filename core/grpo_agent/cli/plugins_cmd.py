"""`grpo-agent plugins list`: which distributions are installed and what each registered."""
from __future__ import annotations

import json
from typing import Annotated

import typer

app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)


@app.callback()
def plugins() -> None:
    """Inspect installed plugins."""


@app.command("list")
def list_plugins(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """List plugins: distribution, version, hooks and the names each registered.

    Example: grpo-agent plugins list
    """
    from grpo_agent.plugins import load_registry
    from grpo_agent.plugins.options import declared_options

    registry = load_registry()
    rows = registry.plugins
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        typer.echo(f"{row['distribution']} {row['version']}  (plugin {row['name']})")
        for kind, names in row["registered"].items():
            typer.echo(f"    {kind}: {', '.join(names)}")
            if kind == "environment":
                continue  # env options: `grpo-agent env show NAME`
            for name in names:
                for option in declared_options(registry.entries[kind][name].obj):
                    typer.echo(f"      --plugin-arg {name}.{option.summary()}")
        if not row["registered"]:
            typer.echo(f"    hooks: {', '.join(row['hooks']) or '(none)'}")
        if row["problem"]:
            typer.echo(f"    warning: {row['problem']}")
