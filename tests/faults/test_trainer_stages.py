"""Trainer stages hung on purpose: each weight-sync phase (the gloo transport's finish call
included) against a server that accepts the connection and never answers, and the queue pull against a worker that never sends. The stall
report names the stage (and the phase) before the call's own timeout ends it."""
from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from grpo_agent import stall
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train.batching import StepPlanner
from grpo_agent.train.checkpoint import PromptLedger
from grpo_agent.train.step_source import StepSource
from grpo_agent.types import TrainingSample, TrainingSequence
from grpo_agent.weight_sync.transports import gloo
from grpo_agent.weight_sync.transports.control import ServerControl, finish_push, start_update

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome


@pytest.fixture
def frozen_server():
    """A TCP server that accepts and then never replies: a SIGSTOPped vLLM, seen from outside."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


@pytest.fixture
def watch(tmp_path, monkeypatch):
    monkeypatch.setattr(stall, "ABORT_GRACE_S", 600.0)  # the call's own timeout ends it first
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             stall_timeouts={"weight_sync": 1, "queue_pull": 1})
    started = stall.StallWatch(config, "trainer", context=lambda: {"model_version": 4}).start()
    yield started
    started.stop()


@pytest.mark.parametrize(("phase", "call"), [
    ("weight_sync/pause", lambda control: start_update(control)),
    ("weight_sync/resume", lambda control: finish_push(control, 5)),
    ("weight_sync/cache_reset", lambda control: finish_push(control, 5, version_set=True)),
])
def test_a_hung_weight_sync_phase_is_named(frozen_server, watch, tmp_path, phase, call, record_property):
    control = ServerControl(frozen_server, timeout=3.0)
    started = time.time()
    with pytest.raises(httpx.ReadTimeout):
        call(control)
    _record_report_time(record_property, tmp_path, started, stall.stage_deadline(watch.config, phase))
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["stage"] == phase and report["server"] == frozen_server
    assert report["action"] == "stopping the run" and report["context"] == {"model_version": 4}
    assert "weight_sync/transports/control.py" in report["stacks"]["trainer"]


class FinishHangs(ServerControl):
    """A server whose control routes answer at once, except `/finish_weight_update` (the gloo
    transport's finish call), which goes to the frozen server."""

    def call(self, method, path, **kwargs):
        if path == "/finish_weight_update":
            return super().call(method, path, **kwargs)
        return {"world_size": 1} if path == "/get_world_size" else None


def _record_report_time(record_property, out, started: float, deadline_s: float) -> None:
    """The outcome of a hung trainer phase is its report (the call's own timeout comes later):
    when the monitor wrote it."""
    record_fault_to_outcome(record_property, (out / stall.REPORT_NAME).stat().st_mtime - started,
                            deadline_s)


def test_a_hung_weight_sync_finish_is_named(frozen_server, watch, tmp_path, monkeypatch, record_property):
    # The server's engine end of the transfer group is a stand-in: only the finish call hangs.
    monkeypatch.setattr(gloo, "open_group", lambda *args: (None, "group"))
    monkeypatch.setattr(gloo, "broadcast_from_trainer", lambda group, chunk: None)
    sync = gloo.GlooWeightSync(FinishHangs(frozen_server, timeout=3.0), timeout=3.0)
    started = time.time()
    with pytest.raises(httpx.ReadTimeout):
        sync.push([("lm_head.weight", torch.zeros(4, 2))], 5)
    _record_report_time(record_property, tmp_path, started,
                        stall.stage_deadline(watch.config, "weight_sync/finish"))
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert (report["stage"], report["version"]) == ("weight_sync/finish", 5)
    assert report["action"] == "stopping the run"
    assert "weight_sync/transports/gloo.py" in report["stacks"]["trainer"]


class SilentWorker:
    """The rollout worker's seam: alive, but never sends anything."""

    pid = None
    queue_size = 0

    def pull(self, timeout):
        time.sleep(timeout)
        return []


def test_a_queue_pull_that_never_gets_an_item_stops_with_the_report(watch, tmp_path, record_property):
    source = StepSource(SilentWorker(), ledger=PromptLedger(), epochs_done=lambda taken=(): False,
                        window=SimpleNamespace(add=lambda *a: None),
                        no_progress_timeout=watch.config.no_progress_timeout)
    started = time.monotonic()
    with pytest.raises(stall.StageStalled, match="stage 'queue_pull'"):
        source.next_step(StepPlanner(token_budget=64, num_processes=1, grad_accum_steps=1))
    record_fault_to_outcome(record_property, time.monotonic() - started,
                            stall.stage_deadline(watch.config, "queue_pull"))
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["stage"] == "queue_pull" and report["elapsed_s"] >= 1
    assert "next_step" in report["stacks"]["trainer"]


class ServerDown(SilentWorker):
    """A worker that lost its server: the step source restores it before pulling again."""

    server_down = True


def test_a_server_restore_in_the_queue_pull_runs_on_its_own_deadline(watch, tmp_path):
    # queue_pull's deadline is 1 s here, the restore takes 3.5 s: within server_restore's.
    worker, seen = ServerDown(), []

    def restore():
        time.sleep(3.5)
        seen.extend(s["stage"] for s in watch.in_flight())
        worker.server_down = False

    source = StepSource(worker, ledger=PromptLedger(), epochs_done=lambda taken=(): bool(seen),
                        window=SimpleNamespace(add=lambda *a: None), restore_server=restore,
                        no_progress_timeout=watch.config.no_progress_timeout)
    assert source.next_step(StepPlanner(token_budget=64, num_processes=1, grad_accum_steps=1))[0] == []
    assert seen == ["queue_pull", "server_restore"]
    assert not (tmp_path / stall.REPORT_NAME).exists()  # the pull's clock stopped meanwhile


def test_a_server_restore_past_its_deadline_is_named(tmp_path, monkeypatch, record_property):
    """A restore (restart, or waiting for an external server) that outlasts `server_restore`'s
    deadline: the report names that stage, not the queue pull it runs inside."""
    monkeypatch.setattr(stall, "ABORT_GRACE_S", 600.0)  # the restore returns before an abort
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             stall_timeouts={"server_restore": 1, "queue_pull": 600})
    watch = stall.StallWatch(config, "trainer", context=lambda: {"model_version": 4}).start()
    worker, report_path = ServerDown(), tmp_path / stall.REPORT_NAME
    waited = []

    def restore():  # a server that takes 3 s to come back
        began = time.monotonic()
        while not report_path.exists() and time.monotonic() - began < 3.0:
            time.sleep(0.05)
        waited.append(time.monotonic() - began)
        worker.server_down = False

    source = StepSource(worker, ledger=PromptLedger(), epochs_done=lambda taken=(): bool(waited),
                        window=SimpleNamespace(add=lambda *a: None), restore_server=restore,
                        no_progress_timeout=config.no_progress_timeout)
    try:
        source.next_step(StepPlanner(token_budget=64, num_processes=1, grad_accum_steps=1))
    finally:
        watch.stop()
    record_fault_to_outcome(record_property, waited[0], stall.stage_deadline(config, "server_restore"))
    report = json.loads(report_path.read_text())
    assert report["stage"] == "server_restore" and report["elapsed_s"] >= 1
    assert "restore" in report["stacks"]["trainer"]


class OversizeWorker(SilentWorker):
    """Every sample it sends is longer than the step's token budget (a run whose token_budget
    is below its rollouts' length), a new prompt each pull."""

    def __init__(self) -> None:
        self.prompts = 0

    def pull(self, timeout):
        time.sleep(0.05)
        self.prompts += 1
        if self.prompts > 100:  # 5 s, past no_progress_timeout=1 s
            raise AssertionError("the queue pull went on taking oversize samples")
        sequence = TrainingSequence(token_ids=list(range(100)), trained_mask=[1] * 100,
                                    sampler_logprobs=[-1.0] * 100)
        return [TrainingSample(sequence=sequence, advantage=1.0, model_version=0, group_id=self.prompts,
                               row_index=self.prompts, prompt_index=self.prompts)]


def test_a_run_whose_every_sample_is_longer_than_token_budget_stops_naming_it(caplog):
    """A harness run with token_budget=256 and 406-token samples logged 'Dropping a sample of
    406 tokens' 6,260 times in 8 min and never trained nor stopped: each oversize sample counted
    as progress, so neither the no-progress stop nor the starvation warning came."""
    source = StepSource(OversizeWorker(), ledger=PromptLedger(), epochs_done=lambda taken=(): False,
                        window=SimpleNamespace(add=lambda *a: None), no_progress_timeout=1)
    planner = StepPlanner(token_budget=64, num_processes=1, grad_accum_steps=1)
    with caplog.at_level(logging.ERROR, logger="grpo_agent.train.batching"), \
            pytest.raises(stall.StageStalled, match="no_progress_timeout=1 s") as raised:
        source.next_step(planner)
    assert "samples are longer than token_budget" in str(raised.value)
    assert len(planner.dropped) >= 2  # each sample was dropped, none trained
