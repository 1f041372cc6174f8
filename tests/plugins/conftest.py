"""Fixtures that run the `grpo-agent` CLI in-process or as the installed console script."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONSOLE_SCRIPT = Path(sys.executable).parent / "grpo-agent"


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    from grpo_agent.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(list(args))
    captured = capsys.readouterr()
    return done.value.code or 0, captured.out, captured.err


def run_script(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def cli(capsys):
    """`cli(*args) -> (exit_code, stdout, stderr)`, run in this process."""
    return lambda *args: run_in_process(capsys, *args)


@pytest.fixture
def cli_script():
    """`cli_script(*args, env=None) -> CompletedProcess` of the installed console script."""
    return run_script
