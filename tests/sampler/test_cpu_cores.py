"""Disjoint cores for a local CPU vLLM server and the trainer (grpo_agent.sampler.cpu_cores)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from grpo_agent.sampler.cpu_cores import (
    OMP_BIND_ENV,
    SERVER_NICE,
    CoreSplit,
    lower_priority,
    split_cores,
    trainer_on,
)
from grpo_agent.train import run


def test_split_gives_the_server_the_first_half_and_the_trainer_the_rest():
    split = split_cores({3, 0, 2, 1, 4})
    assert (split.server, split.trainer) == ([0, 1], [2, 3, 4])
    assert split.server_env() == {OMP_BIND_ENV: "0,1"}
    assert split_cores({5}) is None  # one core: nothing to split
    # in core order, whatever order the affinity set iterates in ({64, 1, 2, 3} starts at 64)
    assert split_cores({64, 1, 2, 3}) == CoreSplit(server=[1, 2], trainer=[3, 64])


def test_trainer_on_pins_this_process_and_restores_it():
    before_cores, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(before_cores)
    with trainer_on([core]):
        assert os.sched_getaffinity(0) == {core}
        assert torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before_cores
    assert torch.get_num_threads() == before_threads


def test_a_users_own_vllm_binding_is_left_alone(monkeypatch):
    monkeypatch.setenv(OMP_BIND_ENV, "0-3")
    assert run._core_split() is None
    monkeypatch.delenv(OMP_BIND_ENV)
    expected = None if torch.cuda.is_available() else split_cores()
    assert run._core_split() == expected


# A session leader that starts a child a moment later (as vLLM's API server starts its engine).
LEADER = ("import subprocess, sys, time; time.sleep(1.0); "
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
          "print(child.pid, flush=True); time.sleep(60)")


def _autogroup_nice(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except OSError:
        return None  # no autogroups on this kernel


def test_lower_priority_covers_the_session_and_what_it_starts_later():
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        lower_priority(leader.pid, SERVER_NICE)
        child = int(leader.stdout.readline())
        assert os.getpriority(os.PRIO_PROCESS, leader.pid) == SERVER_NICE
        assert os.getpriority(os.PRIO_PROCESS, child) == SERVER_NICE
        if Path("/proc/self/autogroup").exists():  # the session's share against the trainer's
            assert _autogroup_nice(leader.pid) == _autogroup_nice(child) == SERVER_NICE
        assert os.getpriority(os.PRIO_PROCESS, 0) != SERVER_NICE  # this process is untouched
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_a_managed_server_runs_at_its_nice_value_after_a_restart_too(tmp_path, monkeypatch):
    from grpo_agent.sampler.server import ManagedVLLMServer

    monkeypatch.setattr(ManagedVLLMServer, "command", lambda self: [sys.executable, "-c", LEADER])
    monkeypatch.setattr(ManagedVLLMServer, "_wait_until_healthy", lambda self: None)  # no vLLM
    server = ManagedVLLMServer(tmp_path, nice=SERVER_NICE, log_path=tmp_path / "server.log")
    try:
        for start in (server.start, server.restart):
            start()
            assert os.getpriority(os.PRIO_PROCESS, server.pid) == SERVER_NICE
    finally:
        server.stop()


def test_the_cli_starts_its_cpu_server_below_the_trainers_priority(tmp_path, monkeypatch):
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.sampler import server as server_module

    started = {}

    class Recorded:
        def __init__(self, model, **kwargs):
            started.update(kwargs)
            self.base_url, self.pid, self.log_path = "http://127.0.0.1:1", 1, "/tmp/vllm-1.log"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(server_module, "ManagedVLLMServer", Recorded)
    monkeypatch.setattr(server_module, "managed_max_model_len", lambda *args: 64)
    cores = sorted(os.sched_getaffinity(0))
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none")
    for split, nice in ((CoreSplit(server=cores[:1], trainer=cores), SERVER_NICE), (None, None)):
        monkeypatch.setattr(run, "_core_split", lambda split=split: split)
        with run._server(str(tmp_path), None, None, config):
            assert started["nice"] == nice
