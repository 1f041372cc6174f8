"""Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the trainer and its
rollout worker. The worker leaves it to the trainer (which stops it): before, a worker still
importing died with its own KeyboardInterrupt traceback under the run's clean message."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo_agent.testing.processes import descendants, left_in_session

SCRIPT = Path(__file__).with_name("ctrl_c_worker_script.py")
GUARD_S = 120  # start-up on a loaded box (imports transformers twice); a hang guard


def test_ctrl_c_while_the_worker_imports_leaves_no_traceback_and_no_process(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "starting\n"
        deadline = time.monotonic() + GUARD_S
        while not _spawned_worker(proc.pid):  # it sleeps in its import
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=GUARD_S)
        assert (proc.returncode, out) == (130, "interrupted\n"), err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert not left_in_session(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _spawned_worker(pid: int) -> bool:
    """Whether `pid` has spawned its worker (multiprocessing's resource tracker aside)."""
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return True
    return False
