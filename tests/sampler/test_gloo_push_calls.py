"""The control calls of one gloo push (a fake server at the HTTP seam; the real server's side
is tests/sampler/test_weight_sync.py): the version rides on /finish_weight_update and the prefix
cache is reset once, preempting running requests, so a push costs four round trips, not five,
while requests run as when none do. Also what the group's opening sends, the server's refusals,
and the disk transport's calls."""
import threading
import time

import pytest
import torch
from grpo_agent.sampler.errors import RequestRejectedError, WeightSyncError
from grpo_agent.weight_sync.transports import build_weight_sync, gloo
from grpo_agent.weight_sync.transports.control import ServerControl
from grpo_agent.weight_sync.transports.disk import DiskWeightSync
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


class GroupControl(RecordingControl):
    """`RecordingControl` with one server worker, and an /update_weights that `update` answers."""

    def __init__(self, update=None):
        super().__init__()
        self.update = update

    def call(self, method, path, *, json_body=None, params=None, timeout=None):
        if path == "/get_world_size":
            self.calls.append((path, params))
            return {"world_size": 1}
        if path == "/update_weights" and self.update is not None:
            self.calls.append((path, json_body))
            return self.update()
        return super().call(method, path, json_body=json_body, params=params, timeout=timeout)


def test_the_first_push_opens_the_group_as_rank_0_and_describes_every_tensor(monkeypatch):
    opened = []
    monkeypatch.setattr(gloo, "open_group", lambda *args: opened.append(args) or ("store", "group"))
    monkeypatch.setattr(gloo, "broadcast_from_trainer", lambda group, buffer: None)
    control = GroupControl()
    sync = GlooWeightSync(control, chunk_bytes=1024, timeout=30)
    try:
        sync.push([("w", torch.ones(2, 3)), ("n", torch.zeros(4, dtype=torch.bfloat16))], version=1)
        sync.push([("w", torch.ones(2, 3))], version=2)  # the group stays open
    finally:
        sync.close()
    calls = dict(control.calls)
    assert calls["/get_world_size"] == {"include_dp": "true"}
    init_info = calls["/init_weight_transfer_engine"]["init_info"]
    assert {k: init_info[k] for k in ("rank_offset", "world_size", "chunk_bytes", "timeout_s")} == {
        "rank_offset": 1, "world_size": 2, "chunk_bytes": 1024, "timeout_s": 30}
    assert [args[2:4] for args in opened] == [(0, 2)]  # the trainer: rank 0 of 1 + 1 worker
    update = next(body for path, body in control.calls if path == "/update_weights")["update_info"]
    assert update == {"names": ["w", "n"], "dtype_names": ["float32", "bfloat16"],
                      "shapes": [[2, 3], [4]]}
    assert [path for path, _ in control.calls].count("/init_weight_transfer_engine") == 1
    assert control.calls[-1][0] == "/shutdown_weight_transfer_engine"


def test_reopen_opens_a_new_group_with_the_next_push(monkeypatch):
    monkeypatch.setattr(gloo, "open_group", lambda *args: ("store", "group"))
    monkeypatch.setattr(gloo, "broadcast_from_trainer", lambda group, buffer: None)
    control = GroupControl()
    sync = GlooWeightSync(control)
    try:
        sync.push([("w", torch.ones(3))], version=1)
        sync.reopen()
        sync.push([("w", torch.ones(3))], version=2)
    finally:
        sync.close()
    assert [path for path, _ in control.calls].count("/init_weight_transfer_engine") == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_rendezvous_that_fails_says_so(monkeypatch):
    def fail(*args):
        raise RuntimeError("connection refused")

    monkeypatch.setattr(gloo, "open_group", fail)
    sync = GlooWeightSync(GroupControl())
    try:
        with pytest.raises(WeightSyncError, match="rendezvous"):
            sync.push([("w", torch.ones(3))], version=1)
    finally:
        sync.close()


def test_an_init_the_server_refuses_after_the_rendezvous_is_raised(monkeypatch):
    monkeypatch.setattr(gloo, "open_group", lambda *args: ("store", "group"))

    class RefusesInit(GroupControl):
        def call(self, method, path, **kwargs):
            if path == "/init_weight_transfer_engine":
                time.sleep(0.2)  # the group opened first
                raise RequestRejectedError("engine failed to start", status_code=500)
            return super().call(method, path, **kwargs)

    control = RefusesInit()
    sync = GlooWeightSync(control)
    try:
        with pytest.raises(RequestRejectedError, match="engine failed"):
            sync.push([("w", torch.ones(3))], version=1)
    finally:
        sync.close()
    assert "/update_weights" not in [path for path, _ in control.calls]


def test_an_update_the_server_refuses_mid_transfer_stops_the_push_before_its_finish(monkeypatch):
    """The refusal is surfaced before the next chunk (not after every chunk went out) and the
    version is not announced."""
    first_sent = threading.Event()
    sent = []

    def broadcast(group, buffer):
        sent.append(buffer)
        first_sent.set()
        time.sleep(0.2)  # the server's refusal arrives while this chunk is on the wire

    def refuse():
        assert first_sent.wait(10)
        raise RequestRejectedError("update_weights: unknown parameter 'w'", status_code=500)

    monkeypatch.setattr(gloo, "broadcast_from_trainer", broadcast)
    control = GroupControl(update=refuse)
    sync = GlooWeightSync(control, chunk_bytes=12)
    sync._group = object()
    try:
        with pytest.raises(RequestRejectedError, match="unknown parameter"):
            sync.push([("w", torch.ones(3)), ("b", torch.ones(3)), ("c", torch.ones(3))], version=4)
    finally:
        sync._group = None
        sync.close()
    assert len(sent) == 1
    assert "/finish_weight_update" not in [path for path, _ in control.calls]


def test_a_prepared_push_is_a_snapshot_sent_as_its_version(monkeypatch):
    sent = []
    monkeypatch.setattr(gloo, "broadcast_from_trainer", lambda group, buffer: sent.append(buffer.clone()))
    control = RecordingControl()
    sync = GlooWeightSync(control)
    sync._group = object()
    weight = torch.ones(3)
    try:
        packed = sync.prepare([("w", weight)], version=7)  # one tensor: a chunk of its own
        weight.add_(1.0)  # the next step trains on
        sync.send(packed)
    finally:
        sync._group = None
        sync.close()
    assert packed.version == 7 and dict(control.calls)["/finish_weight_update"] == {"weight_version": "7"}
    assert torch.equal(sent[0].view(torch.float32), torch.ones(3))


def test_closing_asks_the_server_to_shut_its_engine_down_and_survives_its_refusal(caplog):
    class RefusesShutdown(RecordingControl):
        def call(self, method, path, *, json_body=None, params=None, timeout=None):
            self.calls.append((path, timeout))
            raise RequestRejectedError("busy", status_code=500)

    control = RefusesShutdown()
    sync = GlooWeightSync(control)
    sync._group = object()
    sync.close()
    assert control.calls == [("/shutdown_weight_transfer_engine", gloo.CLOSE_TIMEOUT_S)]
    assert "could not shut down" in caplog.text


def test_build_caps_the_gloo_timeout_and_refuses_an_unknown_backend():
    sync = build_weight_sync("http://127.0.0.1:9", backend="gloo", timeout=1800)
    try:
        assert sync.timeout == 300.0
    finally:
        sync.close()
    with pytest.raises(ValueError, match="Unknown weight sync backend 'ipc'"):
        build_weight_sync("http://127.0.0.1:9", backend="ipc")


def test_a_disk_push_reloads_its_version_folder_sets_the_version_and_keeps_only_the_latest(tmp_path):
    control = RecordingControl()
    sync = DiskWeightSync(control, tmp_path)
    try:
        timings = sync.push([("w", torch.ones(3)), ("h", torch.ones(2, dtype=torch.float16))], 3)
        sync.push([("w", torch.ones(3))], 4)
    finally:
        sync.close()
    reloads = [body["kwargs"]["weights_path"] for path, body in control.calls if path == "/collective_rpc"]
    assert reloads == [str(tmp_path / "version-3"), str(tmp_path / "version-4")]
    versions = [body for path, body in control.calls if path == "/update_weight_version"]
    assert versions == [{"new_version": "3"}, {"new_version": "4"}]
    assert [p.name for p in tmp_path.iterdir()] == ["version-4"]  # the caller's folder stays
    assert timings.num_bytes == 16


def test_a_disk_sync_deletes_the_temporary_folder_it_made_when_closed():
    """Its last version is a full copy of the weights, in /dev/shm (memory) where there is one."""
    sync = DiskWeightSync(RecordingControl())
    folder = sync.work_dir
    try:
        sync.push([("w", torch.ones(3))], 1)
        assert (folder / "version-1" / "model.safetensors").is_file()
    finally:
        sync.close()
    assert not folder.exists()
