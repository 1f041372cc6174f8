"""When a weight push overlaps the next step (`weight_sync.full`), and what the trainer sees
of it: the version is announced only once sent, a failed send surfaces at the next push or
settle and is retried after a restore, and the cases that must push inside the step do."""
import threading
from types import SimpleNamespace

import pytest
import torch
from grpo_agent import AsyncGRPOConfig
from grpo_agent.sampler import WeightSyncError, recovery
from grpo_agent.weight_sync.full import WeightPusher
from grpo_agent.weight_sync.pusher import build_weight_pusher
from grpo_agent.weight_sync.transports.control import SyncTimings


class HeldSync:
    """A transport whose sends wait for `release` (so the test decides when a push lands)
    and fail while `failing` is set; it records the bytes of each version it sent."""

    def __init__(self):
        self.release, self.sent, self.failing = threading.Event(), {}, False
        self.ended = threading.Event()  # set when a send returned or raised

    def prepare(self, weights, version):
        return SimpleNamespace(version=version, tensors={n: t.clone() for n, t in weights})

    def send(self, packed):
        try:
            assert self.release.wait(30)
            if self.failing:
                raise WeightSyncError("gloo transfer: connection reset by peer")
            self.sent[packed.version] = packed.tensors
            return SyncTimings(pause_s=0.0, transfer_s=0.01, total_s=0.01, num_bytes=4)
        finally:
            self.ended.set()

    def push(self, weights, version):
        return self.send(self.prepare(weights, version))

    def reopen(self): ...

    def close(self): ...


@pytest.fixture
def pusher(tmp_path, monkeypatch):
    sync = HeldSync()
    monkeypatch.setattr("grpo_agent.weight_sync.full.build_weight_sync", lambda *a, **k: sync)
    # a restored server still takes gloo (asked at the first push after a restore)
    monkeypatch.setattr("grpo_agent.weight_sync.full.server_backend", lambda *a: "gloo")
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    made = WeightPusher(args, backend="gloo")
    yield made, sync
    sync.release.set()
    made.close()


def test_the_version_is_announced_once_the_send_landed_with_the_snapshot(pusher):
    made, sync = pusher
    served = []
    made.on_served = served.append
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    made.push(model, 5)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step trains on while the push is held
    assert served == []  # the worker must not label groups with version 5 yet
    sync.release.set()
    assert made.wait()["perf/weight_sync_transfer_s"] == 0.01
    assert served == [5]
    assert torch.equal(sync.sent[5]["weight"], before)


def test_a_failed_background_send_is_retried_with_the_weights_of_the_next_push(pusher, monkeypatch):
    made, sync = pusher
    restored = []
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: restored.append(url) or "was restarted")
    keeper = recovery.ServerRecovery("http://127.0.0.1:1", 5)
    model = torch.nn.Linear(2, 2)
    sync.failing = True
    sync.release.set()
    keeper.push(made, model, 1)  # returns at once; its send fails in the background
    assert sync.ended.wait(30)
    sync.release.clear()
    with torch.no_grad():
        model.weight.add_(1.0)
    sync.failing = False
    threading.Timer(0.2, sync.release.set).start()
    metrics = keeper.push(made, model, 2)  # raises the failure inside, restores, pushes 2
    assert restored and keeper.restarts == 1 and metrics[recovery.RESTARTS_METRIC] == 1
    assert list(sync.sent) == [2] and torch.equal(sync.sent[2]["weight"], model.weight)


def test_settle_raises_nothing_when_the_push_landed_and_retries_when_it_failed(pusher, monkeypatch):
    made, sync = pusher
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    keeper = recovery.ServerRecovery("http://127.0.0.1:1", 5)
    model = torch.nn.Linear(2, 2)
    sync.release.set()
    keeper.push(made, model, 3)
    assert keeper.settle(made, model, 3)["perf/weight_sync_transfer_s"] == 0.01
    sync.failing = True
    sync.ended.clear()
    keeper.push(made, model, 4)
    assert sync.ended.wait(30)  # its send failed in the background
    sync.failing = False
    assert keeper.settle(made, model, 4)[recovery.RESTARTS_METRIC] == 1  # restored, sent again
    assert keeper.restarts == 1 and list(sync.sent) == [3, 4]
    sync.failing = True
    keeper.push(made, model, 5)
    with pytest.raises(WeightSyncError, match="connection reset"):  # the retry fails too
        keeper.settle(made, model, 5)
    assert keeper.restarts == 1 and list(sync.sent) == [3, 4]


@pytest.mark.parametrize(("backend", "max_staleness", "background"), [
    ("gloo", 4, True),
    ("gloo", 0, False),  # under the max_staleness=0 hold nothing samples until the push lands
    ("disk", 4, False),  # no snapshot: the files are written from the model
])
def test_which_pushes_overlap_the_next_step(tmp_path, backend, max_staleness, background):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                           max_staleness=max_staleness)
    facts = SimpleNamespace(lora=None, holds_pushed_weights=False, weight_transfer_backend=backend)
    made = build_weight_pusher(args, torch.nn.Linear(2, 2), facts)
    try:
        assert made.background is background
    finally:
        made.close()


def test_a_model_above_the_snapshot_limit_pushes_inside_the_step(pusher, monkeypatch):
    made, sync = pusher
    monkeypatch.setattr("grpo_agent.weight_sync.full.BACKGROUND_MAX_BYTES", 8)
    served = []
    made.on_served = served.append
    sync.release.set()
    metrics = made.push(torch.nn.Linear(2, 2), 6)  # 24 bytes of weights
    assert served == [6] and metrics["perf/weight_sync_transfer_s"] == 0.01


def test_a_failed_push_inside_the_step_raises_and_announces_nothing(pusher, monkeypatch):
    made, sync = pusher
    monkeypatch.setattr("grpo_agent.weight_sync.full.BACKGROUND_MAX_BYTES", 8)
    served = []
    made.on_served = served.append
    sync.failing = True
    sync.release.set()
    with pytest.raises(WeightSyncError, match="connection reset"):
        made.push(torch.nn.Linear(2, 2), 6)
    assert served == [] and sync.sent == {}


def test_a_model_of_exactly_the_snapshot_limit_overlaps_the_next_step(pusher, monkeypatch):
    made, sync = pusher
    monkeypatch.setattr("grpo_agent.weight_sync.full.BACKGROUND_MAX_BYTES", 24)
    made.push(torch.nn.Linear(2, 2), 6)  # 24 bytes of weights: snapshotted, sent later
    assert made._sending is not None and sync.sent == {}
    sync.release.set()
    made.wait()
    assert list(sync.sent) == [6]


def test_the_next_push_reports_the_landed_pushs_timings_and_bytes(pusher):
    made, sync = pusher
    sync.release.set()
    model = torch.nn.Linear(2, 2)
    made.push(model, 1)
    assert sync.ended.wait(30)
    metrics = made.push(model, 2)
    assert metrics["perf/weight_sync_transfer_s"] == 0.01 and "perf/weight_sync_pause_s" in metrics
    assert made.last_num_bytes == 4
    made.wait()


def test_reopen_forgets_a_failed_background_push_and_reopens_the_transport(pusher):
    made, sync = pusher
    reopened = []
    sync.reopen = lambda: reopened.append(True)
    sync.failing = True
    sync.release.set()
    made.push(torch.nn.Linear(2, 2), 1)
    made.reopen()  # the failure is not raised: the restore pushes again
    assert reopened == [True] and made.wait() == {}


def test_a_restored_server_that_cannot_say_its_backend_fails_the_push_and_is_asked_again(
        pusher, monkeypatch):
    """After a restore the first push asks the server its weight-transfer backend
    (`_follow_server_backend`). When asking fails, pushing by the old one may send into a
    server configured for another: the push must fail (so the recovery retries it) and
    announce nothing, and the next push asks again."""
    from grpo_agent.sampler.errors import ServerUnreachableError

    made, sync = pusher
    served = []
    made.on_served = served.append
    sync.release.set()
    made.reopen()

    def unanswered(*args):
        raise ServerUnreachableError("No vLLM server answered at http://127.0.0.1:1")

    monkeypatch.setattr("grpo_agent.weight_sync.full.server_backend", unanswered)
    with pytest.raises(ServerUnreachableError, match="No vLLM server answered"):
        made.push(torch.nn.Linear(2, 2), 3)
    assert served == [] and sync.sent == {}
    monkeypatch.setattr("grpo_agent.weight_sync.full.server_backend", lambda *a: "gloo")
    made.push(torch.nn.Linear(2, 2), 3)
    made.wait()
    assert served == [3] and list(sync.sent) == [3]


def test_close_logs_a_last_push_that_did_not_land_and_closes_the_transport(pusher, caplog):
    made, sync = pusher
    closed = []
    sync.close = lambda: closed.append(True)
    sync.failing = True
    made.push(torch.nn.Linear(2, 2), 1)
    threading.Timer(0.2, sync.release.set).start()
    with caplog.at_level("WARNING", logger="grpo_agent.weight_sync.full"):
        made.close()
    assert "did not land" in caplog.text and closed == [True]


def test_the_initial_push_is_skipped_only_for_weights_loaded_from_the_checkpoint_and_unchanged(
        pusher):
    """A fresh server serves the checkpoint it loaded. The initial push was skipped on every
    fresh server, so a model edited or fine-tuned in memory before train() had its first
    rollouts sampled by the checkpoint's weights, labelled version 0. Now it is skipped only
    for weights the trainer loaded itself (`remember_loaded_weights`) that did not change
    since; any edit (one element through `.data`, a row swap that keeps every sum) or a model
    passed in as an object pushes, and a changed torch thread count does not."""
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.train.weights import remember_loaded_weights
    from transformers import AutoModelForCausalLM

    made, _ = pusher

    def loaded():
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.bfloat16)
        remember_loaded_weights(model)
        return model

    model = loaded()
    assert made.needs_initial_push(model, holds_pushed_weights=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert not made.needs_initial_push(model, holds_pushed_weights=False)
    finally:
        torch.set_num_threads(threads)
    model.model.layers[1].mlp.down_proj.weight.data[3, 5] += 0.5  # no version-counter bump
    assert made.needs_initial_push(model, holds_pushed_weights=False)
    model = loaded()
    with torch.no_grad():
        weight = model.model.layers[0].self_attn.q_proj.weight
        weight[[0, 1]] = weight[[1, 0]]
    assert made.needs_initial_push(model, holds_pushed_weights=False)
    passed_in = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.bfloat16)
    assert made.needs_initial_push(passed_in, holds_pushed_weights=False)


def test_a_wrapped_model_is_pushed_under_its_own_parameter_names(pusher):
    made, sync = pusher
    sync.release.set()
    made.push(SimpleNamespace(module=torch.nn.Linear(2, 2)), 1)  # a DDP-style wrapper
    made.wait()
    assert set(sync.sent[1]) == {"weight", "bias"}
