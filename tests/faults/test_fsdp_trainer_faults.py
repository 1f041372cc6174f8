"""A whole 2-process FSDP2 `AsyncGRPOTrainer` (gloo, CPU) against a real vLLM server, hit by a
fault mid-run (issue 22): the server SIGKILLed after the first push (rank 0 restarts it, both
ranks push the trained weights again, the new server samples with them and the run reaches
max_steps), and rank 1 SIGSTOPped (rank 0's stall report names the collective
phase and rank 1, exit 3). Rank 0 starts and restarts its own server: slow, run by
bench/faults.py. The decision logic alone is tests/faults/test_recovery_rules.py."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpo_agent import stall
from grpo_agent.sampler.server import find_free_port
from grpo_agent.stall import STALL_EXIT_CODE

SCRIPT = Path(__file__).with_name("fsdp_trainer_fault_script.py")
sys.path.insert(0, str(SCRIPT.parent))
from fault_helpers import check_served_versions, record_fault_to_outcome
from fsdp_trainer_fault_script import MAX_STEPS, TIMEOUTS

RUN_CONFIG = SimpleNamespace(**TIMEOUTS)  # the phase deadlines of the script's run

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(os.environ.get("GRPO_AGENT_LONG_FAULTS") != "1",
                                 reason="minutes (two trainer processes, server starts): run by bench/faults.py")]
HANG_GUARD_S = 900  # server starts on a loaded box take minutes; far past it means a hang


def run_two_ranks(model: Path, out: Path, fault: str) -> tuple[list[int | None], str, float]:
    """Both ranks as torchrun would start them: their exit codes (None: still running, then
    killed), rank 0's output, and when rank 0 exited (time.time())."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    port = str(find_free_port())
    logs = [open(out / f"rank{r}.log", "w") for r in (0, 1)]  # noqa: SIM115 - closed below
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(model), port, str(out), fault],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True)
             for r in (0, 1)]
    try:
        procs[0].wait(timeout=HANG_GUARD_S)
        exited_at = time.time()
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[1].wait(timeout=60)
        codes = [proc.poll() for proc in procs]
    finally:
        for proc in procs:  # a rank still running (stopped, or hung), its worker, the server
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for log in logs:
            log.close()
        _kill_servers(out)
    return codes, (out / "rank0.log").read_text(errors="replace"), exited_at


def _kill_servers(out: Path) -> None:
    """The servers rank 0 started run in sessions of their own: never leave one behind."""
    pids = out / "server-pids"
    for pid in set(pids.read_text().split()) if pids.exists() else ():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGKILL)


def test_a_server_killed_under_fsdp_is_restarted_and_both_ranks_push_again(tiny_model_path, tmp_path,
                                                                            record_property):
    out = tmp_path / "run"
    codes, output, _ = run_two_ranks(tiny_model_path, out, "kill-server")
    assert codes == [0, 0], output[-6000:]
    assert [(out / f"done-rank{r}").read_text() for r in (0, 1)] == [str(MAX_STEPS)] * 2
    server_pids = (out / "server-pids").read_text().split()
    assert server_pids[0] != server_pids[-1], "the server was not restarted"
    history = json.loads((out / "log_history.json").read_text())
    assert sum(e.get("server/restart_count", 0.0) for e in history) == 1
    assert sum(e.get("rollout/server_lost_group_count", 0.0) for e in history) >= 1
    # The server was killed after the first push, so the restore had trained weights to push.
    pushed = int(re.search(r"weights version (\d+) pushed again", output).group(1))
    assert pushed >= 1, output[-6000:]
    steps = json.loads((out / "steps.json").read_text())
    restored = next(s for s in steps if s["restarts"] == 1)
    after = [v for s in steps if s["step"] > restored["step"] for v in s["versions"]]
    # On-policy (max_staleness=0), so no backlog of the old server's samples fills the steps
    # after the restore: they train samples of the pushed version or later (a step's carry is
    # rechecked against the staleness bound when the next step opens).
    assert after and max(after) >= pushed, (pushed, steps)
    assert all(max(s["versions"], default=0) < s["model_version"] for s in steps), steps
    killed_at = check_served_versions(out / "groups.jsonl", pushed)
    restored_at = float((out / "restored-at-rank0").read_text().split()[0])
    record_fault_to_outcome(record_property, restored_at - killed_at,
                            stall.collective_deadline(RUN_CONFIG, "server restore"))




def test_a_stopped_rank_stops_the_whole_trainer_with_a_report_naming_it(tiny_model_path, tmp_path,
                                                                        record_property):
    out = tmp_path / "run"
    codes, output, exited_at = run_two_ranks(tiny_model_path, out, "stop-rank1")
    assert codes[0] == STALL_EXIT_CODE, output[-6000:]
    report = json.loads((out / "stall_report.json").read_text())
    assert report["stage"] == "collective" and report["missing_ranks"] == [1], report
    assert report["phase"] == "train step" and report["step"] == 2
    (rank1,) = report["ranks"]
    assert rank1["state"] == "stopped"
    assert "STALL in the trainer: stage 'collective' (phase=train step" in output
    stopped_at = float((out / "stopped-at").read_text())
    record_fault_to_outcome(record_property, exited_at - stopped_at,
                            stall.collective_deadline(RUN_CONFIG, "train step"))
