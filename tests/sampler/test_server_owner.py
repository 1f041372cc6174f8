"""A managed vLLM server stops, engine and all, when the process that started it dies without
cleaning up (found: a script holding a `ManagedVLLMServer`, stopped with SIGTERM, left the server
running). The server runs `vllm_entry` in its own session; here the "server" is `vllm_entry`'s
watch plus a grandchild in its process group standing in for vLLM's engine process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from grpo_agent.testing.processes import gone_within, kill_quietly

SERVER = """
import subprocess, sys, time
from grpo_agent.sampler.vllm_entry import stop_when_owner_dies
if sys.argv[2] == "watch":
    stop_when_owner_dies(int(sys.argv[1]), poll_s=0.1)
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(engine.pid, flush=True)
time.sleep(600)
"""
OWNER = """
import os, subprocess, sys, time
server = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]],
                          stdout=subprocess.PIPE, text=True, start_new_session=True)
print(server.pid, server.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _server_gone_after_owner_killed(mode: str, wait_s: float) -> bool:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, SERVER, mode], stdout=subprocess.PIPE, text=True)
    server, engine = map(int, owner.stdout.readline().split())
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    try:
        return gone_within(server, wait_s) and gone_within(engine, 1.0)
    finally:
        for pid in (server, engine):
            kill_quietly(pid, signal.SIGKILL)


def test_the_server_and_its_engine_stop_when_the_owner_is_killed():
    assert _server_gone_after_owner_killed("watch", wait_s=30)


def test_without_the_watch_they_would_outlive_it():
    assert not _server_gone_after_owner_killed("none", wait_s=3)


def test_the_owner_pid_reaches_the_server(tmp_path):
    from grpo_agent.sampler.server import ManagedVLLMServer
    from grpo_agent.sampler.vllm_entry import OWNER_PID_ENV

    server = ManagedVLLMServer(str(tmp_path), log_path=tmp_path / "server.log")
    assert server.environment()[OWNER_PID_ENV] == str(os.getpid())


def test_a_second_ctrl_c_during_the_stop_kills_the_server_at_once():
    """Ctrl-C while the server takes its SIGTERM grace (here it ignores SIGTERM) gives up the
    wait and SIGKILLs the group: the run exits at once and leaves no server."""
    import _thread
    import threading

    import pytest
    from grpo_agent.sampler.server import _stop_process_group

    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
    server = subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, start_new_session=True)
    server.stdout.readline()  # it ignores SIGTERM now
    timer = threading.Timer(0.5, _thread.interrupt_main)  # the second Ctrl-C
    # as in a terminal: a runner started as a background job ignores SIGINT, and then
    # interrupt_main raises nothing (the CI rehearsal's "DID NOT RAISE")
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _stop_process_group(server)
        assert gone_within(server.pid, 2.0)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, inherited)
        kill_quietly(server.pid, signal.SIGKILL)
        server.wait()
