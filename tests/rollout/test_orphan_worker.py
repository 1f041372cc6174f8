"""A rollout worker whose trainer was SIGKILLed exits by itself (found: an orphaned worker went
on starting agent episodes with nobody reading them)."""
from __future__ import annotations

import signal
import subprocess
import sys

from grpo_agent.testing.processes import gone_within, kill_quietly

# The "trainer": spawns a child the way RolloutWorker does, prints its pid, then waits forever.
TRAINER = """
import multiprocessing as mp, os, sys, time
from grpo_agent.rollout.worker import exit_when_orphaned

def child(watch, trainer_pid):
    if watch:
        exit_when_orphaned(trainer_pid, poll_s=0.1)
    time.sleep(600)

if __name__ == "__main__":
    process = mp.get_context("spawn").Process(target=child, args=(sys.argv[1] == "watch", os.getpid()), daemon=True)
    process.start()
    print(process.pid, flush=True)
    time.sleep(600)
"""


def _child_gone_after_trainer_killed(tmp_path, mode: str, wait_s: float) -> bool:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    child = int(trainer.stdout.readline())
    trainer.send_signal(signal.SIGKILL)  # at once: the child may not have started its watch yet
    trainer.wait()
    try:
        return gone_within(child, wait_s)
    finally:
        kill_quietly(child, signal.SIGKILL)


def test_a_worker_exits_when_its_trainer_is_killed(tmp_path):
    assert _child_gone_after_trainer_killed(tmp_path, "watch", wait_s=60)  # ~1 s once imported


def test_without_the_watch_the_child_would_outlive_it(tmp_path):
    """The control: the same child without the watch is still running (so the test above can fail)."""
    assert not _child_gone_after_trainer_killed(tmp_path, "none", wait_s=5)
