"""Generate `docs/cli.md` from the CLI's own help (`python -m grpo_agent.cli.docs > docs/cli.md`).

Design decision: the reference is rendered with click's plain formatter at a fixed width, not
typer's rich panels, so the text is stable across terminals and a test can compare it with
the committed file. Commands contributed by third-party plugins are left out (they depend on
what is installed); the built-in doctor group is included.
"""
from __future__ import annotations

from typing import Any

import typer

WIDTH = 100


def _context(command: Any, name: str, parent: Any = None) -> Any:
    return typer.Context(command, info_name=name, parent=parent, terminal_width=WIDTH,
                         max_content_width=WIDTH)


def _walk(command: Any, ctx: Any, path: str, out: list[str]) -> None:
    command.rich_markup_mode = None  # plain click formatting: stable text
    out += [f"## `{path}`", "", "```", command.get_help(ctx).rstrip(), "```", ""]
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            _walk(sub, _context(sub, name, ctx), f"{path} {name}", out)


def cli_reference() -> str:
    """The markdown reference of every built-in command."""
    from grpo_agent.cli import main

    if "doctor" not in {info.name for info in main.app.registered_groups}:
        from grpo_agent.cli import doctor

        main.app.add_typer(doctor.app, name="doctor")
    root = typer.main.get_command(main.app)
    out = [
        "# grpo-agent CLI reference",
        "",
        "Generated from the CLI help: `python -m grpo_agent.cli.docs > docs/cli.md`",
        "(a test fails when this file is out of date).",
        "",
    ]
    _walk(root, _context(root, "grpo-agent"), "grpo-agent", out)
    return "\n".join(out)


if __name__ == "__main__":
    print(cli_reference())
