"""The restore rule of `sampler.recovery` with stand-ins at its seams: an external server that
comes back in time (and one that does not), and a push retried once after a restore.
The real managed server, killed and restarted, is tests/faults/test_server_restart.py."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from grpo_agent.sampler import recovery
from grpo_agent.sampler.errors import ServerUnreachableError, WeightSyncError
from grpo_agent.sampler.server import find_free_port


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve_after(port: int, delay_s: float) -> ThreadingHTTPServer:
    """A /health that starts answering after `delay_s` (the external server coming back)."""
    holder = {}

    def run():
        time.sleep(delay_s)
        holder["server"] = ThreadingHTTPServer(("127.0.0.1", port), _Health)
        holder["server"].serve_forever(poll_interval=0.1)

    threading.Thread(target=run, daemon=True).start()
    return holder


def test_an_external_server_that_comes_back_in_time_is_waited_for():
    port = find_free_port()
    holder = _serve_after(port, 2.0)
    try:
        what = recovery.restore_server(f"http://127.0.0.1:{port}", timeout_s=30)
    finally:
        if "server" in holder:
            holder["server"].shutdown()
    assert what.startswith("came back after")


def test_an_external_server_that_stays_away_ends_the_wait_with_what_to_do():
    url = f"http://127.0.0.1:{find_free_port()}"
    with pytest.raises(ServerUnreachableError, match=r"did not come back within vllm_server_timeout=1 s.*resume"):
        recovery.restore_server(url, timeout_s=1)


class _Pusher:
    def __init__(self, failures: int):
        self.failures, self.pushed, self.reopened = failures, [], 0

    def reopen(self):
        self.reopened += 1

    def push(self, model, version):
        if self.failures:
            self.failures -= 1
            raise WeightSyncError("gloo transfer: connection reset by peer")
        self.pushed.append(version)
        return {"perf/weight_sync_s": 0.1}


def test_a_failed_push_is_retried_once_after_the_restore(monkeypatch):
    restored = []
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: restored.append(url) or "was restarted")
    keeper = recovery.ServerRecovery("http://127.0.0.1:1", 5)
    pusher = _Pusher(failures=1)
    metrics = keeper.push(pusher, None, 3)
    assert pusher.pushed == [3] and pusher.reopened == 1 and restored
    assert metrics[recovery.RESTARTS_METRIC] == 1 and keeper.restarts == 1
    with pytest.raises(WeightSyncError):  # twice in a row: the run stops
        keeper.push(_Pusher(failures=2), None, 4)


def test_without_a_single_trainer_process_the_error_stands(monkeypatch):
    monkeypatch.setattr(recovery, "restore_server", lambda *a: pytest.fail("restored under FSDP"))
    keeper = recovery.ServerRecovery("http://127.0.0.1:1", 5, enabled=False)
    with pytest.raises(WeightSyncError):
        keeper.push(_Pusher(failures=1), None, 3)
    with pytest.raises(ServerUnreachableError, match="single trainer process"):
        keeper.restore(_Pusher(failures=0), None, 3, cause="the rollout worker lost it")
