"""Entry point of the `grpo-agent` console script: one typer app, thin command modules.

Design decision: heavy libraries (torch, transformers, vLLM, datasets) are imported inside
command bodies only, so `grpo-agent --help` stays well under a second. Known user mistakes
(`CLI_ERRORS`) print one line and exit 1; `--debug` or `GRPO_AGENT_DEBUG=1` shows the full
traceback instead. Plugins add commands through the `register_commands` hook.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Annotated

import typer

from grpo_agent.cli import config_cmd, env, plugins_cmd, train
from grpo_agent.cli import eval as eval_cmd
from grpo_agent.cli.errors import DEBUG_ENV

app = typer.Typer(
    name="grpo-agent",
    help="Asynchronous GRPO for LLM agents: train, inspect environments and plugins.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: no rich import, so --help stays fast
    add_completion=False,
)
app.add_typer(plugins_cmd.app, name="plugins")
app.add_typer(env.app, name="env")
app.add_typer(config_cmd.app, name="config")
app.command("train")(train.train)
app.command("eval")(eval_cmd.evaluate)


def _version(value: bool) -> None:
    if value:
        from grpo_agent._version import __version__

        typer.echo(f"grpo-agent {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")
    ] = False,
) -> None:
    """Asynchronous GRPO for LLM agents."""
    if debug:
        os.environ[DEBUG_ENV] = "1"


@app.command("tiny-model")
def tiny_model(
    out_dir: Annotated[str, typer.Argument(help="Folder to write the model and tokenizer to.")],
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if it exists.")] = False,
    arch: Annotated[
        str, typer.Option("--arch", help="qwen3 (attention only) or qwen3_5 (Gated DeltaNet hybrid).")
    ] = "qwen3",
) -> None:
    """Build the deterministic tiny Qwen3 (or Qwen3.5 hybrid) test model, no download, into OUT_DIR.

    Example: grpo-agent tiny-model /tmp/tiny; grpo-agent tiny-model /tmp/tiny35 --arch qwen3_5
    """
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.train.reporting import quiet_library_bars_off_terminal

    quiet_library_bars_off_terminal()  # save_pretrained's "Writing model shards"
    typer.echo(str(build_tiny_model(out_dir, force=force, arch=arch)))


@functools.cache
def _add_optional_commands() -> str | None:
    """The doctor group (if present) and commands contributed by installed plugins; returns
    why no plugin could load (the plugin host's error), which `main` reports once."""
    if importlib.util.find_spec("grpo_agent.cli.doctor") is not None:
        from grpo_agent.cli import doctor

        app.add_typer(doctor.app, name="doctor")
    from grpo_agent.plugins.errors import PluginError
    from grpo_agent.plugins.manager import add_plugin_commands, plugin_manager

    try:
        pm = plugin_manager()
    except PluginError as err:  # the CLI must still start so `plugins list` can report it
        return str(err)
    for problem in add_plugin_commands(pm, app):  # a raising hook costs only its own commands
        typer.echo(f"Warning: plugin commands not loaded: {problem}", err=True)
    return None


def _known_errors() -> tuple[type[BaseException], ...]:
    from grpo_agent.cli.errors import CLI_ERRORS

    return CLI_ERRORS


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; known errors become one line on stderr and exit code 1.

    A plugin host that cannot load is a warning after commands that do not need it (`--help`,
    `config show`); a command that fails with that same error prints it once, as its error."""
    broken = _add_optional_commands()
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args or os.environ.get(DEBUG_ENV) == "1"
    warned = broken is None
    try:
        with _ends_by_ctrl_c():
            app(args=args, prog_name="grpo-agent")  # typer reports usage errors and exits itself
    except _known_errors() as err:
        warned = warned or str(err) == broken
        if debug:
            raise
        if not warned:
            typer.echo(f"Warning: plugin commands not loaded: {broken}", err=True)
            warned = True
        typer.echo(f"Error: {err} (run with --debug for the traceback)", err=True)
        sys.exit(1)
    finally:
        if not warned:
            typer.echo(f"Warning: plugin commands not loaded: {broken}", err=True)


@contextlib.contextmanager
def _ends_by_ctrl_c() -> Iterator[None]:
    """A command that Ctrl-C stopped (typer turns the KeyboardInterrupt into exit 130, after the
    run's cleanup) ends by SIGINT itself, as a program should that a signal ended: a shell tells
    the two apart, and `for ...; do grpo-agent train ...; done` went on to the next run after a
    plain exit 130 (bash takes it as a child that handled Ctrl-C). Only a real SIGINT counts,
    not a KeyboardInterrupt raised in code; a SIGINT the process ignores stays ignored. (Python's
    own exit by SIGINT for an uncaught KeyboardInterrupt was lost in a run's interpreter
    teardown: it exited 1.)"""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received = []

    def interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    except SystemExit as done:
        if received and done.code == 128 + signal.SIGINT:
            _die_by_sigint()
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _die_by_sigint() -> None:
    """What the interpreter's exit would do (atexit handlers: multiprocessing's, finalizers;
    flushed output), then SIGINT with its default action."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)

if __name__ == "__main__":
    main()
