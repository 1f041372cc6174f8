"""The control calls of one gloo push (a fake server at the HTTP seam; the real server's side
is tests/sampler/test_weight_sync.py): the version rides on /finish_weight_update and the prefix
cache is reset once, preempting running requests, so a push costs four round trips, not five,
while requests run as when none do."""
import torch
from grpo_agent.weight_sync.transports import gloo
from grpo_agent.weight_sync.transports.control import ServerControl
from grpo_agent.weight_sync.transports.gloo import GlooWeightSync


class RecordingControl(ServerControl):
    """The real control client with its HTTP call replaced by a recording."""

    def __init__(self):
        super().__init__("http://127.0.0.1:9", timeout=1.0)
        self.calls = []

    def call(self, method, path, *, json_body=None, params=None, timeout=None):
        self.calls.append((path, json_body))
        if path == "/reset_prefix_cache":
            # vLLM while requests run: a plain reset fails, one that preempts them succeeds.
            return {"success": (params or {}).get("reset_running_requests") == "true"}
        return None


def test_a_push_sets_the_version_with_the_finish_call(monkeypatch):
    sent = []
    monkeypatch.setattr(gloo, "broadcast_from_trainer", lambda group, buffer: sent.append(buffer))
    control = RecordingControl()
    sync = GlooWeightSync(control)
    sync._group = object()  # an open transfer group
    try:
        timings = sync.push([("w", torch.ones(3)), ("b", torch.zeros(2))], version=5)
    finally:
        sync._group = None
        sync.close()
    assert [path for path, _ in control.calls] == [
        "/start_weight_update", "/update_weights", "/finish_weight_update",
        "/reset_prefix_cache"]
    assert dict(control.calls)["/finish_weight_update"] == {"weight_version": "5"}
    assert timings.num_bytes == 20 and sum(b.numel() for b in sent) == 20
