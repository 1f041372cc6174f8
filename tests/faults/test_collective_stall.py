"""The trainer's collectives under FSDP have a deadline: 2 gloo ranks on CPU, rank 1 hung
(SIGSTOP) or dead before the step's FSDP all-gather. Rank 0 writes stall_report.json naming
the `collective` stage, its phase and the missing rank, and exits non-zero instead of waiting
in the all-gather (the process group's own timeout is an hour)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from grpo_agent.stall import STALL_EXIT_CODE

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome

DEADLINE_S = 3.0  # collective_rank_script.py's collective deadline (the train step phase)

SCRIPT = Path(__file__).with_name("collective_rank_script.py")
HANG_GUARD_S = 240  # far past the deadline: the run hung


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(out: Path, fault: str, record_property) -> tuple[int, str]:
    """Both ranks as a torchrun would start them; rank 0's exit code and output. Records the
    time from rank 1 going missing to rank 0's exit."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(out), fault],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        output, _ = procs[0].communicate(timeout=HANG_GUARD_S)
        exited_at = time.time()
        if (out / "fault-at").exists():
            record_fault_to_outcome(record_property, exited_at - float((out / "fault-at").read_text()),
                                    DEADLINE_S)
        return procs[0].returncode, output
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.communicate()


def test_a_stopped_rank_is_named_and_the_waiting_rank_exits(tmp_path, record_property):
    code, output = run_two_ranks(tmp_path, "stop", record_property)
    assert code == STALL_EXIT_CODE, output[-3000:]
    report = json.loads((tmp_path / "stall_report.json").read_text())
    assert (report["stage"], report["phase"], report["step"]) == ("collective", "train step", 2)
    assert report["missing_ranks"] == [1]
    (rank1,) = report["ranks"]
    assert rank1["state"] == "stopped" and rank1["phase"] == "train step"
    assert "SIGSTOP" in report["missing_rank_stacks"]["trainer-rank1"]
    assert "forward" in report["stacks"]["trainer"]  # rank 0's own stack: waiting in the step
    assert "STALL in the trainer: stage 'collective'" in output


def test_a_dead_rank_is_named_at_once(tmp_path, record_property):
    code, output = run_two_ranks(tmp_path, "die", record_property)
    assert code != 0
    assert "StageStalled" in output and "rank(s) [1] left the run" in output, output[-3000:]
    report = json.loads((tmp_path / "stall_report.json").read_text())
    assert (report["stage"], report["phase"], report["missing_ranks"]) == ("collective", "train step", [1])
    assert report["ranks"][0]["state"] == "dead"
