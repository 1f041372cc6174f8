"""Ctrl-C in the terminal of a shell loop of runs, while the first run starts its vLLM server: a
terminal sends SIGINT to the whole foreground group (bash, `grpo-agent train`), here
`os.killpg`. The run says it was interrupted, stops the server it started, and ends by SIGINT,
so bash ends the loop too. Before, it exited 130 without a word and bash started the next run."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_agent.sampler.vllm_entry import OWNER_PID_ENV
from grpo_agent.testing.processes import descendants, gone_within, left_in_session

pytestmark = pytest.mark.e2e
GUARD_S = 180  # the CLI's start on a loaded box; a hang guard
LOOP = 'for run in 1 2; do "$0" -m grpo_agent.cli.main train --env words --output-dir "$1/$run"; echo "next run $?"; done'

# SIGINT's default action for the loop, as a terminal's shell has it, then exec bash (same pid): a
# runner started as a background job (`make test &`) ignores SIGINT, bash cannot take back a
# signal ignored on entry, and the run would train on past the Ctrl-C (the CI rehearsal's failure)
AS_IN_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execvp(sys.argv[1], sys.argv[1:])")


@pytest.fixture(scope="module")
def interrupted_loop(tmp_path_factory):
    """The loop's exit status and output, and whether the server it started is gone."""
    tmp = tmp_path_factory.mktemp("ctrl-c")
    log = tmp / "loop.log"
    with open(log, "wb") as out:
        loop = subprocess.Popen([sys.executable, "-c", AS_IN_A_TERMINAL, "bash", "-c", LOOP,
                                 sys.executable, str(tmp)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + GUARD_S
        while (server := _managed_server(loop.pid)) is None:
            assert loop.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(loop.pid, signal.SIGINT)  # as the terminal's Ctrl-C
        deadline = time.monotonic() + GUARD_S
        while loop.poll() is None and "next run" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        code = loop.poll()  # None: bash went on to the next run
        return code, log.read_text(errors="replace"), gone_within(server, 30.0), left_in_session(loop.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(loop.pid, signal.SIGKILL)
        loop.wait()
        if server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server, signal.SIGKILL)


def test_ctrl_c_ends_the_shell_loop(interrupted_loop):
    code, text, _, _ = interrupted_loop
    assert code == -signal.SIGINT, text[-3000:]  # bash ended by SIGINT, as its run did
    assert "next run" not in text, text[-3000:]


def test_ctrl_c_before_training_says_so_and_leaves_nothing(interrupted_loop):
    _, text, server_gone, left = interrupted_loop
    assert text.count("The run was interrupted (KeyboardInterrupt) before training began. To go on, "
                      "run it again") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert server_gone and not left, left


def _managed_server(session: int) -> int | None:
    """The pid of the vLLM server a run in `session` started (its own session), once it runs."""
    runs = [pid for pid in descendants(session) if b"grpo_agent.cli.main" in _read(pid, "cmdline")]
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        if any(f"{OWNER_PID_ENV}={run}".encode() in _read(pid, "environ").split(b"\0") for run in runs):
            return pid
    return None


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""
