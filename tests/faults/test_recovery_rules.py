"""The restore rule of `sampler.recovery` with stand-ins at its seams: an external server that
comes back in time (and one that does not), and a push retried once after a restore.
Under FSDP two ranks run in threads, their gather a threading barrier: every rank reaches the
same decision. The real managed server, killed and restarted, is
tests/faults/test_server_restart.py (one trainer process and two)."""
from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar
from urllib.parse import urlparse

import httpx
import pytest
from grpo_agent.sampler import recovery
from grpo_agent.sampler.errors import (
    ServerChangedError,
    ServerStartupError,
    ServerUnreachableError,
    WeightSyncError,
)
from grpo_agent.sampler.server import find_free_port

from tests.stand_in_http import send_reply


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        sent = self.requestline.split()[1]  # `path` folds a leading "//"; vLLM's router does not
        self.send_response(200 if sent == "/health" else 404)
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


def test_which_sampler_failures_mean_the_server_is_lost():
    """Nothing answering means lost (even if it answers again: it may be a new server without
    our weights); a refused request never does; any other sampler failure does only if
    /health does not answer either. A non-sampler error is not the server's."""
    import asyncio

    from grpo_agent.sampler.errors import RequestRejectedError, SamplerError

    healthy = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    up, down = f"http://127.0.0.1:{healthy.server_address[1]}", f"http://127.0.0.1:{find_free_port()}"

    def lost(error, url):
        return asyncio.run(recovery.means_server_lost(error, url))

    try:
        assert lost(ServerUnreachableError("refused"), up)
        assert not lost(RequestRejectedError("bad", status_code=400), down)
        assert not lost(ValueError("a bug of ours"), down)
        assert not lost(SamplerError("answer cut short"), up)
        assert lost(SamplerError("answer cut short"), down)
    finally:
        healthy.shutdown()
        healthy.server_close()


def test_an_external_server_that_comes_back_in_time_is_waited_for():
    port = find_free_port()
    holder = _serve_after(port, 2.0)
    try:
        what = recovery.restore_server(f"http://127.0.0.1:{port}", timeout_s=30)
    finally:
        if "server" in holder:
            holder["server"].shutdown()
    assert what.startswith("came back after")


def test_an_external_server_that_stays_away_ends_the_wait_with_what_to_do(caplog):
    url = f"http://127.0.0.1:{find_free_port()}"
    caplog.set_level(logging.WARNING, logger=recovery.__name__)
    with pytest.raises(ServerUnreachableError, match=r"did not come back within vllm_server_timeout=1 s.*resume"):
        recovery.restore_server(url, timeout_s=1)
    # said when the wait begins (it may last vllm_server_timeout), not only when it ends
    assert re.search(r"does not answer; waiting up to vllm_server_timeout=1 s.*Restart it at "
                     r"the same URL", caplog.text), caplog.text


class _Pusher:
    def __init__(self, failures: int, error: type[Exception] = WeightSyncError):
        self.failures, self.error, self.pushed, self.reopened = failures, error, [], 0

    def reopen(self):
        self.reopened += 1

    def push(self, model, version):
        if self.failures:
            self.failures -= 1
            raise self.error("gloo transfer: connection reset by peer")
        self.pushed.append(version)
        return {"perf/weight_sync_s": 0.1}

    def wait(self):
        return {}


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


class _Ranks:
    """Stand-in for `collectives.RankPhases` of one of two ranks: `gather` meets the other
    rank's thread (a threading barrier in place of the gloo all-gather)."""

    def __init__(self, rank: int, shared: dict):
        self.rank, self.shared, self.phases = rank, shared, []

    def gather(self, value):
        self.shared["values"][self.rank] = value
        self.shared["barrier"].wait(timeout=10)
        values = list(self.shared["values"])
        self.shared["barrier"].wait(timeout=10)  # both read before the next gather writes
        return values

    def during(self, phase, **detail):
        self.phases.append(phase)
        return contextlib.nullcontext()


def _two_ranks(pushers):
    """Both ranks' `ServerRecovery.push` in threads; each rank's result or error."""
    shared = {"values": [None, None], "barrier": threading.Barrier(2)}
    ranks = [_Ranks(r, shared) for r in (0, 1)]
    results = [None, None]

    def run(r):
        try:
            results[r] = recovery.ServerRecovery("http://127.0.0.1:1", 5, ranks=ranks[r]).push(
                pushers[r], None, 3)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            results[r] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results, ranks


def test_under_fsdp_rank_0s_failed_push_is_retried_by_every_rank(monkeypatch):
    restored = []
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: restored.append(url) or "was restarted")
    pushers = [_Pusher(failures=1), _Pusher(failures=0)]
    results, ranks = _two_ranks(pushers)
    assert [p.pushed for p in pushers] == [[3], [3, 3]]  # rank 1 pushed again with rank 0
    assert all(r[recovery.RESTARTS_METRIC] == 1 for r in results), results
    assert len(restored) == 1  # rank 0 alone touched the server
    assert all(rank.phases == ["server restore"] for rank in ranks)


def test_under_fsdp_a_restore_that_fails_on_rank_0_stops_every_rank(monkeypatch):
    def stays_away(url, timeout):
        raise ServerUnreachableError("did not come back within vllm_server_timeout=5 s")

    monkeypatch.setattr(recovery, "restore_server", stays_away)
    results, _ = _two_ranks([_Pusher(failures=1), _Pusher(failures=0)])
    assert isinstance(results[0], ServerUnreachableError)
    assert isinstance(results[1], ServerUnreachableError)
    assert "Rank 0 could not bring the vLLM server" in str(results[1])
    assert "did not come back" in str(results[1])


def test_under_fsdp_a_failure_of_another_rank_stops_every_rank_without_a_restart(monkeypatch):
    monkeypatch.setattr(recovery, "restore_server", lambda *a: pytest.fail("restored for rank 1"))
    results, _ = _two_ranks([_Pusher(failures=0), _Pusher(failures=1)])
    assert isinstance(results[1], WeightSyncError) and "connection reset" in str(results[1])
    assert isinstance(results[0], WeightSyncError) and "Rank(s) [1] failed" in str(results[0])


def test_under_fsdp_a_second_failure_stops_every_rank(monkeypatch):
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    results, _ = _two_ranks([_Pusher(failures=2), _Pusher(failures=0)])
    assert isinstance(results[0], WeightSyncError) and "connection reset" in str(results[0])
    assert isinstance(results[1], WeightSyncError) and "Rank(s) [0] failed" in str(results[1])


class _Slow(_Health):
    def do_GET(self):
        time.sleep(1.0)
        super().do_GET()


def test_health_takes_a_trailing_slash_and_a_health_check_that_times_out_is_no_answer(monkeypatch):
    """A /health slower than HEALTH_TIMEOUT_S is a server not answering (a wedged one), not an
    error out of the check; a base URL ending in "/" still asks /health."""
    import asyncio

    from grpo_agent.sampler.errors import SamplerError

    monkeypatch.setattr(recovery, "HEALTH_TIMEOUT_S", 0.2)
    healthy, slow = (ThreadingHTTPServer(("127.0.0.1", 0), handler) for handler in (_Health, _Slow))
    for server in (healthy, slow):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    up, wedged = (f"http://127.0.0.1:{server.server_address[1]}/" for server in (healthy, slow))
    try:
        assert recovery.server_answers(up)
        assert not asyncio.run(recovery.means_server_lost(SamplerError("cut short"), up))
        assert not recovery.server_answers(wedged)
        assert asyncio.run(recovery.means_server_lost(SamplerError("cut short"), wedged))
    finally:
        for server in (healthy, slow):
            server.shutdown()
            server.server_close()


class _Managed:
    """Stand-in for the `ManagedVLLMServer` this process started at the URL."""

    def __init__(self, running: bool):
        self.running, self.restarts, self.pid = running, 0, 4242

    def is_running(self):
        return self.running

    def restart(self):
        self.restarts += 1


@pytest.mark.parametrize(("running", "answers", "restarted"), [
    (False, False, True),  # its process died: restarted at once, no grace
    (True, True, False),   # alive and answering within the grace: left as it is
    (True, False, True),   # alive but silent past the grace: restarted
])
def test_a_managed_server_is_restarted_unless_its_live_process_answers_within_the_grace(
        monkeypatch, running, answers, restarted):
    server = _Managed(running)
    monkeypatch.setattr(recovery, "managed_server_at", lambda url: server)
    monkeypatch.setattr(recovery, "ALIVE_GRACE_S", 3.0)
    monkeypatch.setattr(recovery, "POLL_S", 0.1)
    healthy = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{healthy.server_address[1] if answers else find_free_port()}"
    began = time.monotonic()
    try:
        what = recovery.restore_server(url, timeout_s=1)  # never the external server's wait
    finally:
        healthy.shutdown()
        healthy.server_close()
    assert server.restarts == int(restarted)
    assert what.startswith("was restarted (pid 4242" if restarted else "answered again")
    if not running:
        assert time.monotonic() - began < 2.0  # a dead process gets no grace


@pytest.mark.parametrize("error", [httpx.ConnectError, RuntimeError], ids=["http", "torch"])
def test_a_push_failing_in_http_or_in_the_transfer_group_is_retried(monkeypatch, error):
    """A control call to a dead server raises httpx's errors, torch.distributed's transfer
    RuntimeError: either may be the server lost, so either gets the restore and the retry."""
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    pusher = _Pusher(failures=1, error=error)
    metrics = recovery.ServerRecovery("http://127.0.0.1:1", 5).push(pusher, None, 3)
    assert pusher.pushed == [3] and metrics[recovery.RESTARTS_METRIC] == 1


def test_a_push_past_its_stall_deadline_stops_the_run_without_a_restore(monkeypatch):
    """A stalled push already wrote its report and aborted; a restore and a retry would only hide
    it behind another wait."""
    from grpo_agent.stall import StageStalled

    monkeypatch.setattr(recovery, "restore_server", lambda *a: pytest.fail("restored a stall"))
    with pytest.raises(StageStalled):
        recovery.ServerRecovery("http://127.0.0.1:1", 5).push(_Pusher(failures=1, error=StageStalled),
                                                               None, 3)


def test_under_fsdp_rank_0s_failed_restart_stops_it_with_its_own_error_and_the_others_with_its_name(
        monkeypatch):
    def restart_fails(url, timeout):
        raise ServerStartupError("vLLM server (pid 7) exited with code 1 before becoming ready")

    monkeypatch.setattr(recovery, "restore_server", restart_fails)
    results, _ = _two_ranks([_Pusher(failures=1), _Pusher(failures=0)])
    assert type(results[0]) is ServerStartupError
    assert isinstance(results[1], ServerUnreachableError) and "exited with code 1" in str(results[1])
    assert "Rank 0 could not bring the vLLM server" in str(results[1])


def test_under_fsdp_the_failing_rank_raises_its_own_error(monkeypatch):
    monkeypatch.setattr(recovery, "restore_server", lambda *a: pytest.fail("restored for rank 1"))
    results, _ = _two_ranks([_Pusher(failures=0), _Pusher(failures=1, error=RuntimeError)])
    assert type(results[1]) is RuntimeError and "connection reset" in str(results[1])
    assert isinstance(results[0], WeightSyncError) and "Rank(s) [1] failed" in str(results[0])


class _ControlRoutes(BaseHTTPRequestHandler):
    """A vLLM server's health, /server_info and the routes a disk push calls; the server
    reports `backend` as its weight-transfer config (None: started without one)."""

    backend: str | None = "gloo"
    served, max_model_len = "tiny/Model", 512  # what /v1/models says
    device, masks, kv_tokens = "cuda", False, None  # /server_info's and /metrics' (None: 404)
    logprobs_mode, max_logprobs, dtype = "processed_logprobs", 20, None  # /server_info's
    dev_mode = True  # False: no /server_info (vLLM without VLLM_SERVER_DEV_MODE=1)
    reloaded: ClassVar[list[str]] = []  # each test makes a subclass with its own lists
    versions: ClassVar[list[str]] = []

    def do_GET(self):
        path = urlparse(self.path).path
        if path == "/health":
            return self._reply({})
        if path == "/v1/models":
            return self._reply({"data": [{"id": self.served, "max_model_len": self.max_model_len}]})
        if path == "/metrics" and self.kv_tokens is not None:
            return self._reply_text(f'vllm:cache_config_info{{kv_cache_size_tokens="{self.kv_tokens}"}} 1.0\n')
        if path != "/server_info" or not self.dev_mode:  # e.g. gloo's /get_world_size
            return self._reply({"detail": "Not Found"}, status=404)
        config = None if self.backend is None else {"backend": self.backend}
        model_config = {"return_sampling_mask": self.masks, "logprobs_mode": self.logprobs_mode,
                        "max_logprobs": self.max_logprobs, "dtype": self.dtype}
        self._reply({"vllm_config": {"weight_transfer_config": config,
                                     "device_config": {"device": self.device},
                                     "model_config": model_config}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        path = urlparse(self.path).path
        if path == "/collective_rpc":
            assert body["method"] == "reload_weights"
            type(self).reloaded.append(body["kwargs"]["weights_path"])
        elif path == "/update_weight_version":
            type(self).versions.append(body["new_version"])
        self._reply({"success": True} if path == "/reset_prefix_cache" else {})

    def _reply_text(self, text):
        send_reply(self, text, content_type="text/plain")

    def _reply(self, body, status=200):
        send_reply(self, body, status)

    def log_message(self, *args):
        pass


def test_a_server_restarted_with_another_weight_transfer_backend_gets_the_push_by_that_one(
        tmp_path, caplog):
    """The start probe found gloo; the server was restarted by hand without
    --weight-transfer-config. The restore's push asks it again and goes by disk (before, it
    tried gloo's engine on a server without one and the run stopped); a later restore of the
    same server keeps the disk transport it has."""
    import torch
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.weight_sync.full import WeightPusher
    from safetensors.torch import load_file

    handler = type("Routes", (_ControlRoutes,), {"reloaded": [], "versions": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                           vllm_server_base_url=url, vllm_server_timeout=5)
    pusher = WeightPusher(args, backend="gloo")  # what check_server's probe read at train start
    model = torch.nn.Linear(2, 2)
    keeper = recovery.ServerRecovery(url, 5)
    try:
        assert pusher.background  # gloo snapshots: its pushes overlap the next step
        handler.backend = None  # restarted without --weight-transfer-config
        with caplog.at_level(logging.WARNING, logger="grpo_agent.weight_sync.full"):
            keeper.restore(pusher, model, 3, cause="the rollout worker lost it")
            pushed = load_file(f"{handler.reloaded[0]}/model.safetensors")
            version_3 = model.weight.detach().clone()
            with torch.no_grad():
                model.weight.add_(1.0)
            keeper.restore(pusher, model, 4, cause="the rollout worker lost it")
        assert handler.versions == ["3", "4"] and keeper.restarts == 2
        assert torch.equal(pushed["weight"], version_3)
        assert pusher.backend == "disk" and not pusher.background
        switched = [r.getMessage() for r in caplog.records if "takes weights by" in r.getMessage()]
        assert switched == [(f"The restarted vLLM server at {url} takes weights by disk, no "
                             "longer by gloo (its --weight-transfer-config changed): pushing by "
                             "disk from now on.")]
        first, second = (Path(folder) for folder in handler.reloaded)
        assert second.parent == first.parent and second.name == "version-4"
    finally:
        pusher.close()
        server.shutdown()
        server.server_close()


def _serve(handler) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _pipeline_at(url: str, tmp_path, **config):
    """The trainer's pipeline side as `AsyncGRPOTrainer` holds it at a restore (one process):
    its config, a float32 model named tiny/Model, a stand-in pusher, and the real `recovery`,
    `_restore_server` and token budget (taken as at start from a server of max_model_len 512)."""
    import torch
    import transformers
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.train import setup
    from grpo_agent.train.pipeline import RolloutPipelineMixin

    trainer = type("Trainer", (RolloutPipelineMixin,), {})()
    trainer.args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                   vllm_server_base_url=url, vllm_server_timeout=5,
                                   max_completion_length=64, **config)
    trainer.model = torch.nn.Linear(2, 2)
    trainer.model.config = transformers.PretrainedConfig(name_or_path="tiny/Model")
    trainer.phases, trainer.window = recovery._OneProcess(), SimpleNamespace(update=dict)
    trainer.pusher, trainer.model_version, trainer.source = _Pusher(failures=0), 3, None
    trainer.token_budget = setup.token_budget(trainer.args.token_budget, 512)
    trainer._planning, trainer.state = None, SimpleNamespace(global_step=0)
    return trainer


def test_a_server_that_came_back_serving_another_model_or_a_shorter_length_stops_the_run(
        monkeypatch, tmp_path):
    """Restarted by hand at the same URL with another model (or a --max-model-len that leaves
    no room for max_completion_length): the restore refuses it before any push, naming the
    server, what it serves now and the fix, where before its samples were trained as this
    model's. The trainer's recovery is built with the start checks' model and length."""
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    handler = type("Routes", (_ControlRoutes,), {"served": "other/Llama"})
    server, url = _serve(handler)
    keeper = _pipeline_at(url, tmp_path).recovery
    pusher = _Pusher(failures=0)
    try:
        with pytest.raises(ServerChangedError) as refused:
            keeper.restore(pusher, None, 3, cause="the rollout worker lost it")
        command = refused.value.start_command  # the CLI's "what to do" prints it whole
        assert str(refused.value) == (
            f"The vLLM server at {url} serves 'other/Llama' but this run trains 'tiny/Model'. "
            "It came back so after the run lost it: restart it there with the run's model and "
            f"flags (the run's whole command: `{command}`), then resume from the last checkpoint.")
        # the whole command, not `vllm serve tiny/Model` (which the other checks then refused)
        port = urlparse(url).port
        assert re.search(rf"serve tiny/Model --port {port} --max-model-len 1024 --logprobs-mode "
                         r"processed_logprobs --max-logprobs 20 --enable-scale-out "
                         r"--weight-transfer-config .* --dtype float32$", command), command
        assert command.startswith("VLLM_SERVER_DEV_MODE=1 ")
        from grpo_agent.cli.failure import report_failure

        message, _ = report_failure(refused.value, tmp_path)  # its summary line cuts it
        assert f"  what to do: start the server with `{command}`" in message
        handler.served, handler.max_model_len = "tiny/Model", 64
        with pytest.raises(ServerChangedError, match=(
                rf"max_completion_length=64 leaves no room .* max_model_len is 64\. The vLLM "
                rf"server at {url} came back so .*--max-model-len \(its whole command: `.* "
                rf"--max-model-len 1024 .*`\), then resume")):
            keeper.restore(pusher, None, 3, cause="a weight push failed")
        assert pusher.pushed == [] and keeper.restarts == 0  # nothing reached the server
        handler.max_model_len = 512  # the same model and length again: the push goes on
        metrics = keeper.restore(pusher, None, 3, cause="the rollout worker lost it")
        assert pusher.pushed == [3] and metrics[recovery.RESTARTS_METRIC] == 1
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_came_back_with_flags_that_would_train_wrong_stops_the_run(
        monkeypatch, tmp_path, caplog):
    """The start checks the samples' log-probs depend on, on a server restarted by hand
    mid-run: without --logprobs-mode processed_logprobs (its log-probs ignore temperature, the
    importance ratios skew silently), with too small a --max-logprobs (every request refused),
    without VLLM_SERVER_DEV_MODE=1 (no push reaches it). Each stops the trainer's restore before
    any push, naming the restart's flag; a dtype gap only warns and the run goes on. Before,
    the restore checked the model and length alone and trained on."""
    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    handler = type("Routes", (_ControlRoutes,), {"logprobs_mode": "raw_logprobs"})
    server, url = _serve(handler)
    trainer = _pipeline_at(url, tmp_path)  # num_sampler_logprobs=8: 9 log-probs a token
    resume = "then resume from the last checkpoint"
    try:
        with pytest.raises(ServerChangedError) as refused:
            trainer._restore_server()
        assert str(refused.value) == (
            f"The vLLM server at {url} returns --logprobs-mode raw_logprobs, not the log-probs "
            "of the distribution it samples from, which the loss needs. It came back so after "
            "the run lost it: restart it there with --logprobs-mode processed_logprobs (the "
            f"run's whole command: `{refused.value.start_command}`), {resume}.")
        assert "--logprobs-mode processed_logprobs" in refused.value.start_command
        handler.logprobs_mode, handler.max_logprobs = "processed_logprobs", 5
        with pytest.raises(ServerChangedError, match=(
                rf"--max-logprobs 5, but num_sampler_logprobs=8 asks for 9 per token\. .*restart "
                rf"it there with --max-logprobs 9 \(or more\) \(the run's whole command: "
                rf"`.* --max-logprobs 20 .*`\), {resume} \(or lower "
                r"num_sampler_logprobs\)\.")):
            trainer._restore_server()
        handler.max_logprobs, handler.dev_mode = -1, False
        with pytest.raises(ServerChangedError, match=(
                rf"/server_info with HTTP 404.*restart it there with VLLM_SERVER_DEV_MODE=1 "
                rf"\(the run's whole command: `VLLM_SERVER_DEV_MODE=1 .*`\), {resume}\.")):
            trainer._restore_server()
        assert trainer.pusher.pushed == [] and trainer.recovery.restarts == 0
        handler.dev_mode, handler.dtype = True, "bfloat16"  # the trainer's weights are float32
        with caplog.at_level(logging.WARNING, logger="grpo_agent.sampler.server_facts"):
            trainer._restore_server()
        assert trainer.pusher.pushed == [3] and trainer.recovery.restarts == 1
        assert (f"The restored vLLM server at {url} runs in bfloat16 but the trainer's weights "
                "are float32") in caplog.text and "--dtype float32" in caplog.text
    finally:
        server.shutdown()
        server.server_close()


def test_a_push_that_restored_the_server_lets_the_worker_dispatch_again(monkeypatch, tmp_path):
    """A failed push is retried after a restore (`ServerRecovery.push`). The worker may have
    lost the same server meanwhile: it raised `server_down` and dispatches nothing until the
    trainer clears it. The trainer clears it after every restore, the push's included (it
    also counts the restore, so the worker re-reads the server's facts); a push that landed at
    once leaves the flag alone."""
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.rollout.worker import RolloutWorker

    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    server, url = _serve(type("Routes", (_ControlRoutes,), {}))
    trainer = _pipeline_at(url, tmp_path)
    worker = RolloutWorker(AsyncRolloutLoop, config=trainer.args, model_name="tiny/Model",
                           dataset=[], reward_funcs=[], processing_class=None,
                           token_budget=512)  # its channels, not started
    trainer.source = SimpleNamespace(worker=worker)
    trainer.pusher = _Pusher(failures=1)
    try:
        worker.channels.server_down.set()  # the worker lost the server too
        trainer.push_weights()
        assert trainer.pusher.pushed == [3] and trainer.recovery.restarts == 1
        assert not worker.channels.server_down.is_set()
        assert worker.channels.server_restores.value == 1
        worker.channels.server_down.set()  # lost again, after this push: the pull restores
        trainer.push_weights()
        assert worker.channels.server_down.is_set() and worker.channels.server_restores.value == 1
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("configured", [None, 512], ids=["from-server", "configured"])
def test_the_token_budget_after_a_restore_with_another_max_model_len(
        monkeypatch, tmp_path, caplog, configured):
    """A token budget taken from the server (token_budget=None) grows with a server that
    came back with a larger --max-model-len (before, its longer samples were dropped as
    oversize, counted and nothing said) and keeps its size with a shorter one (samples queued
    from before still fit). A configured budget stays, with the start check's warning that
    longer samples will be dropped. A restore in the middle of a step's pull grows the budget
    of the step being planned too. Whatever was sized from the start budget follows it: the
    FlashAttention choice (`flash_impl.expect_rows`) and the worker's allowance until its first
    step reports (before, both kept the start budget); a measured step then stays."""
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.rollout.worker import RolloutWorker
    from grpo_agent.train import flash_impl

    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    monkeypatch.setattr(flash_impl, "_expected_row_tokens", 512)  # as start_pipeline set it
    handler = type("Routes", (_ControlRoutes,), {})
    server, url = _serve(handler)
    trainer = _pipeline_at(url, tmp_path, token_budget=configured, gradient_accumulation_steps=2,
                           max_staleness=1)  # the published allowance: one step of full rows
    assert trainer.token_budget == 512  # as at start, from a server of max_model_len 512
    worker = RolloutWorker(AsyncRolloutLoop, config=trainer.args, model_name="tiny/Model",
                           dataset=[], reward_funcs=[], processing_class=None,
                           token_budget=512)  # its allowance and channels, not started
    trainer.source = SimpleNamespace(worker=worker)

    def sized():  # the row budget each part of the trainer holds: planner, kernels, allowance
        return (trainer.token_budget, flash_impl._expected_row_tokens,
                worker.allowance.step_tokens // 2, worker.channels.token_allowance.value)

    try:
        handler.max_model_len = 1024
        with caplog.at_level(logging.WARNING):
            trainer._restore_server()
        if configured is None:
            assert sized() == (1024, 1024, 1024, 2 * 1024)
            assert ("token_budget follows the restored vLLM server's max_model_len: 512 -> "
                    "1024") in caplog.text
        else:
            assert sized() == (512, 512, 512, 2 * 512)
            assert ("token_budget=512 is below the restored vLLM server's max_model_len=1024: "
                    "samples longer than the budget will be dropped") in caplog.text
        handler.max_model_len = 256  # shorter: the budget keeps its size
        trainer.state.global_step = 5  # weight_sync_steps > 1: version 3 was pushed earlier
        trainer._restore_server()
        assert trainer.token_budget == (1024 if configured is None else 512)
        assert trainer.pusher.pushed == [3, 3]
        assert trainer.served_step == 5  # version 3 is now step 5's weights (eval/step)
        worker.report_step_tokens(300)  # a measured step: the allowance follows it, not rows

        met = []  # the budget the step's samples after the restore meet

        def pull(planner):  # the worker lost the server in the middle of this step's pull
            handler.max_model_len = 2048
            trainer._restore_server()
            met.append(planner.token_budget)
            return [], 0.0
        trainer.source.next_step = pull
        trainer.phases.enter = lambda *args, **kwargs: None
        trainer._next_step_plan()
        assert met == [2048 if configured is None else 512]
        assert sized()[1:3] == ((2048, 150) if configured is None else (512, 150))
    finally:
        server.shutdown()
        server.server_close()


def test_the_worker_reads_the_servers_facts_again_after_each_restore(tmp_path, caplog):
    """The worker read its server's facts once, at connect; a server restored mid-run (here
    restarted by hand on a CPU machine with another --max-model-len and KV cache, and without
    sampling masks) kept being sent seeds (which crash a CPU engine), masks it cannot return
    and a concurrency cap sized for the old cache. Now the trainer's `server_restored` counts
    the restore and the engine re-reads the facts before its next group; the seed stream goes
    on where it was when a GPU server comes back."""
    import asyncio

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.engine import RolloutEngine
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.rollout.worker import RolloutWorker
    from grpo_agent.sampler.client import SamplerClient

    handler = type("Routes", (_ControlRoutes,), {"masks": True, "kv_tokens": 8 * 512})
    server, url = _serve(handler)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, top_k=20,
                             vllm_server_base_url=url, vllm_server_timeout=5,
                             max_concurrent_rollouts=16, max_completion_length=64)
    worker = RolloutWorker(AsyncRolloutLoop, config=config, model_name="tiny/Model", dataset=[],
                           reward_funcs=[], processing_class=None)  # its channels, not started
    loop = AsyncRolloutLoop(config, "tiny/Model", [], [], None, [0], channels=worker.channels)
    engine = RolloutEngine(loop, worker.channels)

    def facts():
        return (loop.server.max_model_len, engine.cap.value, loop.seeds is not None,
                loop.sampling_params.return_sampling_mask)

    async def main():
        async with SamplerClient(url, timeout=5) as sampler:
            await loop.connect(sampler, None)
            engine._start_scheduling()
            assert facts() == (512, 8, True, True)  # 8 full-length rollouts fit the cache
            first_seed = next(loop.seeds)
            handler.device, handler.masks, handler.max_model_len, handler.kv_tokens = (
                "cpu", False, 1024, 2 * 1024)
            await asyncio.wait_for(engine._wait_for_room(), 5)
            assert facts() == (512, 8, True, True)  # no restore yet: nothing re-read
            worker.server_restored()
            with caplog.at_level(logging.WARNING, logger="grpo_agent.rollout.engine"):
                await asyncio.wait_for(engine._wait_for_room(), 5)
            assert facts() == (1024, 2, False, False)
            assert engine.slots.cap is engine.cap and (await sampler.model_info()).max_model_len == 1024
            assert "max_model_len 512 -> 1024" in caplog.text and "on_cpu False -> True" in caplog.text
            handler.device = "cuda"  # back on a GPU: seeds again, the same stream
            worker.server_restored()
            await asyncio.wait_for(engine._wait_for_room(), 5)
            assert loop.seeds is not None and next(loop.seeds) == first_seed + 1

    _run_then_stop(server, main)


def test_an_evaluation_reads_a_restored_server_again_and_scores_none_across_a_restore(
        monkeypatch, tmp_path):
    """The run's evaluation session (opened once per run) read the server's facts once: after
    the trainer restored the server with a larger --max-model-len, its tool loops still stopped
    at the old one (and its requests named the old model id), and a server restored or lost
    during an evaluation had its rollouts scored against facts never read, or failed the run.
    Now the first evaluation after a restore reads and checks the server again (another model
    is refused, as at open), and one during which it was restored or lost is not scored."""
    import asyncio

    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings, EvaluationInterrupted
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.types import Rollout

    monkeypatch.setattr(recovery, "restore_server", lambda url, timeout: "was restarted")
    handler = type("Routes", (_ControlRoutes,), {})
    server, url = _serve(handler)
    trainer = _pipeline_at(url, tmp_path)
    limits = []  # the context limit each rollout's tool loop stops at (`rollout.agent`)

    class ContextLoop(AsyncRolloutLoop):
        async def generate_one(self, prompt, tools, group_id=0):
            limits.append((await self.sampler.model_info()).max_model_len)
            action = prompt[-1]["content"]
            if action == "restore":  # the trainer restores the server meanwhile
                await asyncio.to_thread(trainer._restore_server)
            if action == "lose":  # what the client raises once its retries found no server
                raise ServerUnreachableError(f"POST {url}/inference/v1/generate failed 6 times")
            return Rollout(completion=[{"role": "assistant", "content": "x"}],
                           completion_ids=[1], turns=[])

    session = EvalSession(ContextLoop, config=trainer.args, processing_class=None,
                          reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                          settings=EvalSettings(), model_name="tiny/Model",
                          restores=trainer.server_restores)

    def rows(*texts):
        return [{"prompt": [{"role": "user", "content": text}]} for text in texts]

    async def main():
        async with session:
            assert (await session.evaluate(rows("a"), 3)).metrics["eval/pass@1"] == 1.0
            handler.max_model_len = 1024
            await asyncio.to_thread(trainer._restore_server)  # between two evaluations
            await session.evaluate(rows("a"), 3)
            assert limits == [512, 1024] and session.loop.server.max_model_len == 1024
            with pytest.raises(EvaluationInterrupted, match=(
                    rf"^The vLLM server at {url} was restored during the evaluation of version "
                    r"3\. None of its rollouts is scored")):
                await session.evaluate(rows("restore"), 3)
            handler.served = "other/Llama"  # restored by hand with another model: refused
            with pytest.raises(ValueError, match="serves 'other/Llama' but the evaluation "
                                                 "evaluates 'tiny/Model'"):
                await session.evaluate(rows("a"), 3)
            handler.served = "tiny/Model"
            with pytest.raises(EvaluationInterrupted, match=(
                    rf"^The vLLM server at {url} was lost during the evaluation of version 3 "
                    r"\(POST .* failed 6 times\)\. None of its rollouts is scored")):
                await session.evaluate(rows("lose"), 3)
            handler.max_model_len = 2048  # came back by hand: no restore counted, read again
            assert (await session.evaluate(rows("a"), 3)).metrics["eval/pass@1"] == 1.0
            assert limits[-1] == 2048 and trainer.server_restores() == 2

    _run_then_stop(server, main)


def test_an_agent_run_that_lost_the_server_interrupts_the_evaluation(tmp_path):
    """The harness gateway answered a lost server's failure as a 502, so the agent run failed
    and was scored as a failure (a wrong 0 in pass@1), or, caught by the agent, scored as it
    returned. Now a run whose call lost the server (nothing answered, or /health does not
    answer either) interrupts the evaluation as a tool loop's request does; a call the server
    failed while it still answers stays the agent's failure."""
    import functools

    import openai
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings, EvaluationInterrupted
    from grpo_agent.rollout.harness import HarnessRolloutLoop
    from grpo_agent.sampler.errors import SamplerError
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.types import TurnRecord
    from transformers import AutoTokenizer

    class Routes(_ControlRoutes):
        healthy = True

        def do_GET(self):
            if urlparse(self.path).path == "/health" and not self.healthy:
                return self._reply({}, status=503)
            return super().do_GET()

    server, url = _serve(Routes)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())

    class ScriptedSampler(HarnessRolloutLoop):
        """The real gateway and agent; the sampler scripted by the row's word."""

        async def generate_one_turn(self, prompt_ids, max_tokens=None):
            text = self.tokenizer.decode(prompt_ids)
            if "lose" in text:  # what the client raises once its retries found no server
                raise ServerUnreachableError(f"POST {url}/inference/v1/generate failed 6 times")
            if "dies" in text:  # cut short as the server dies: /health stops answering
                Routes.healthy = False
                raise SamplerError("the answer was cut short")
            if "cut" in text:  # cut short, the server still up
                raise SamplerError("the answer was cut short")
            ids = tokenizer.encode("done", add_special_tokens=False) + [tokenizer.eos_token_id]
            return TurnRecord(list(prompt_ids), ids, [-0.1] * len(ids), finish_reason="stop",
                              weight_versions=["3"] * len(ids))

    async def agent(client, row):
        word = row["prompt"][0]["content"]
        try:
            await client.chat.completions.create(model="tiny/Model", messages=row["prompt"])
        except openai.InternalServerError:
            if "caught" not in word:
                raise
        return 1.0

    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             vllm_server_base_url=url, vllm_server_timeout=5,
                             max_completion_length=64,
                             chat_template_kwargs={"enable_thinking": False})
    session = EvalSession(functools.partial(ScriptedSampler, agent=agent), config=config,
                          processing_class=tokenizer, reward_funcs=[], settings=EvalSettings(),
                          model_name="tiny/Model")

    def rows(*words):
        return [{"prompt": [{"role": "user", "content": word}]} for word in words]

    async def main():
        async with session:
            scored = await session.evaluate(rows("fine", "cut"), 3)  # the server still answers
            assert scored.metrics["eval/pass@1"] == 0.5
            assert scored.rows[1].rewards == [None]  # the agent's failure
            lost = (rf"^The vLLM server at {url} was lost during the evaluation of version 3 "
                    r"\(POST .* failed 6 times\)\. None of its rollouts is scored")
            with pytest.raises(EvaluationInterrupted, match=lost):
                await session.evaluate(rows("fine", "lose"), 3)
            with pytest.raises(EvaluationInterrupted, match=lost):  # the agent caught the 502
                await session.evaluate(rows("fine", "lose caught"), 3)
            with pytest.raises(EvaluationInterrupted, match=(
                    rf"was lost during the evaluation of version 3 \(the answer was cut short "
                    rf"\(and {url}/health does not answer\)\)")):
                await session.evaluate(rows("fine", "dies"), 3)
            Routes.healthy = True  # back (by hand): read again, and scored
            assert (await session.evaluate(rows("fine"), 3)).metrics["eval/pass@1"] == 1.0

    _run_then_stop(server, main)


def _run_then_stop(server, main) -> None:
    """Run the test's `main` coroutine against a stand-in server, then stop the server."""
    import asyncio

    try:
        asyncio.run(main())
    finally:
        server.shutdown()
        server.server_close()


class _LoraRoutes(_ControlRoutes):
    """A `--enable-lora` server: /v1/models lists the base model then `adapters`, and
    /inference/v1/generate answers a request naming one of them (or the base) with two tokens
    of the base weights' label, any other name with vLLM's 404 for an unknown model."""

    adapters: ClassVar[list[str]] = []

    def do_GET(self):
        if urlparse(self.path).path == "/v1/models":
            base = {"id": self.served, "max_model_len": self.max_model_len}
            return self._reply({"data": [base, *({"id": name} for name in self.adapters)]})
        return super().do_GET()

    def do_POST(self):
        if urlparse(self.path).path != "/inference/v1/generate":
            return super().do_POST()
        model = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]
        if model not in (self.served, *self.adapters):
            return self._reply({"error": {
                "message": f"The model `{model}` does not exist. Valid aliases: {self.served}.",
                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        self._reply({"choices": [{"index": 0, "token_ids": [7, 8], "finish_reason": "stop",
                                  "weight_versions": [{"version": "default", "start": 0, "end": 2}]}]})


def test_an_evaluation_a_restarted_server_refuses_the_adapter_of_is_interrupted_not_failed(
        tmp_path):
    """Under LoRA sync a server restarted before the restore's push landed refuses the
    evaluated version's adapter as an unknown model (vLLM's 404); that was no lost server, so
    the evaluation failed and `take_finished` stopped training. Now a refusal by a server that
    serves none of the run's adapters (or that one again by now) interrupts the evaluation, for
    the tool loop's requests and an agent's calls through the gateway alike; one by a server
    that still serves others of the run's adapters (it ran on, something unloaded that one)
    still fails, naming the adapter and the likely cause."""
    import asyncio
    import functools

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings, EvaluationInterrupted
    from grpo_agent.rollout.harness import HarnessRolloutLoop
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.sampler.errors import RequestRejectedError
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.types import Rollout
    from transformers import AutoTokenizer

    routes = type("Routes", (_LoraRoutes,), {"adapters": ["run-v3"]})
    server, url = _serve(routes)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             vllm_server_base_url=url, vllm_server_timeout=5,
                             max_completion_length=64,
                             chat_template_kwargs={"enable_thinking": False})

    class OneTurnLoop(AsyncRolloutLoop):
        """The loop's real request path (`generate_one_turn`, the adapter by name)."""

        async def generate_one(self, prompt, tools, group_id=0):
            turn = await self.generate_one_turn([5, 6])
            return Rollout(completion=[{"role": "assistant", "content": "x"}],
                           completion_ids=turn.output_ids, turns=[turn])

    async def agent(client, row):
        await client.chat.completions.create(model="tiny/Model", messages=row["prompt"])
        return 1.0

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    loops = {"tool loop": OneTurnLoop, "agent": functools.partial(HarnessRolloutLoop, agent=agent)}
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
    lost = (rf"^The vLLM server at {url} was lost during the evaluation of version 3 \(POST "
            rf"{url}/inference/v1/generate was rejected with HTTP 404: The model `run-v3` does "
            r"not exist\. Valid aliases: tiny/Model\. \(the server now serves none of this run's "
            r"LoRA adapters: it was restarted, and the trainer's restore pushes the adapter "
            r"again\)\)\. None of its rollouts is scored")

    async def main(loop_cls):
        session = EvalSession(loop_cls, config=config, processing_class=tokenizer,
                              reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                              settings=EvalSettings(), lora_name="run", model_name="tiny/Model",
                              restores=lambda: 0)
        async with session:
            routes.adapters = ["run-v3"]
            assert (await session.evaluate(rows, 3)).metrics["eval/pass@1"] == 1.0
            routes.adapters = []  # restarted: the restore's push has not landed yet
            with pytest.raises(EvaluationInterrupted, match=lost):
                await session.evaluate(rows, 3)
            routes.adapters = ["run-v4"]  # running on, version 3's adapter unloaded
            with pytest.raises(RequestRejectedError, match=(
                    rf"^The vLLM server at {url} refused the LoRA adapter 'run-v3' as an unknown "
                    r"model while it still serves this run's run-v4: something unloaded it \(a "
                    r"run started with the same output_dir on this server unloads the adapters "
                    r"named after it\)\. Give each run on a server its own output_dir")):
                await session.evaluate(rows, 3)

    try:
        for loop_cls in loops.values():
            asyncio.run(main(loop_cls))
    finally:
        server.shutdown()
        server.server_close()


def _one_turn_lora_engine(config):
    """(worker, loop, engine, slot, executor) for one-turn rollouts of the run's adapter "run":
    the loop's real request path (`generate_one_turn`, the group's adapter by name) behind an
    unstarted worker's channels; the stand-in sends no log-probs, so no turn is kept to train."""
    import concurrent.futures

    from grpo_agent.rollout.engine import RolloutEngine
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.rollout.prompts import PromptSlot
    from grpo_agent.rollout.worker import RolloutWorker
    from grpo_agent.types import Rollout

    class OneTurnLoop(AsyncRolloutLoop):
        async def generate_one(self, prompt, tools, group_id=0):
            turn = await self.generate_one_turn([5, 6])
            return Rollout(completion=[{"role": "assistant", "content": "x"}],
                           completion_ids=turn.output_ids, turns=[])

    worker = RolloutWorker(OneTurnLoop, config=config, model_name="tiny/Model", dataset=[],
                           reward_funcs=[], processing_class=None, lora_name="run")
    loop = OneTurnLoop(config, "tiny/Model", [], [], None, [0], channels=worker.channels,
                       lora_name="run")
    slot = PromptSlot(prompt_index=0, row_index=0, epoch=0,
                      row={"prompt": [{"role": "user", "content": "hi"}]})
    return (worker, loop, RolloutEngine(loop, worker.channels), slot,
            concurrent.futures.ThreadPoolExecutor(2))


def test_a_training_rollout_whose_adapter_a_restarted_server_refuses_drops_its_group_as_lost(
        tmp_path, monkeypatch):
    """In training, a refusal of the worker's newest adapter stopped the worker (a 404 is no
    lost server to the engine): a server restarted before the trainer's restore pushed the
    adapter again stopped the run instead of being restored. Now a refusal by a server that
    serves none of the run's adapters drops the group as `server_lost` and raises
    `server_down`; under max_staleness=0 one by a server that serves a newer adapter of the
    run (the push unloaded the newest before it told the worker) finishes on the version the
    worker learns; any other stops the run naming the adapter."""
    import asyncio
    import io

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout import loop as loop_module
    from grpo_agent.sampler.client import SamplerClient
    from grpo_agent.sampler.errors import RequestRejectedError
    from grpo_agent.types import PromptConsumed

    requested = []

    class Routes(_LoraRoutes):
        def do_POST(self):
            if urlparse(self.path).path == "/inference/v1/generate":
                body = self.rfile.read(int(self.headers["Content-Length"]))
                requested.append(json.loads(body)["model"])
                self.rfile = io.BytesIO(body)  # read again by _LoraRoutes
            return super().do_POST()

    server, url = _serve(Routes)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             vllm_server_base_url=url, vllm_server_timeout=5, max_staleness=0,
                             num_generations=2, max_completion_length=64,
                             share_first_turn_request=False)  # one request per rollout

    worker, loop, engine, slot, executor = _one_turn_lora_engine(config)

    async def run_group():
        """A group of version 3 as the dispatcher starts it."""
        worker.set_model_version(3)
        requested.clear()
        engine._groups_in_flight += 1
        engine._groups_generating += 1
        engine.slots.promise(config.num_generations)
        await engine._run_group(slot, 0)

    async def main():
        async with SamplerClient(url, timeout=5) as sampler:
            await loop.connect(sampler, executor)
            engine._start_scheduling()
            Routes.adapters = []  # restarted: the restore's push has not landed yet
            await run_group()
            assert worker.channels.server_down.is_set()
            assert worker.channels.samples.get(timeout=5) == PromptConsumed(0, 0, "server_lost")
            worker.channels.server_down.clear()

            Routes.adapters = ["run-v4"]  # a push loaded version 4 and unloaded 3 ...
            announce = asyncio.get_running_loop().call_later(0.3, worker.set_model_version, 4)
            await run_group()  # ... and tells the worker a moment later
            announce.cancel()
            group = engine.score_queue.get_nowait()
            assert group.model_version == 3 and requested == ["run-v3"] * 2 + ["run-v4"] * 2
            assert not worker.channels.server_down.is_set()

            monkeypatch.setattr(loop_module, "ADAPTER_ANNOUNCE_WAIT_S", 0.3)
            for served in (["run-v4"], ["run-v2"]):  # nothing announced / an older one only
                Routes.adapters = served
                with pytest.raises(RequestRejectedError, match=(
                        rf"^The vLLM server at {url} refused the LoRA adapter 'run-v3' as an "
                        rf"unknown model while it still serves this run's {served[0]}: "
                        r"something unloaded it")):
                    await run_group()
            assert not worker.channels.server_down.is_set()

    try:
        asyncio.run(main())
    finally:
        executor.shutdown()
        server.shutdown()
        server.server_close()


def test_a_failed_agent_run_other_weights_answered_is_not_scored_as_a_failure(tmp_path):
    """A failed agent run's rollout had no turns, so the served-version check saw none of its
    tokens: a run whose calls a restarted server's own weights ("default") answered, and whose
    agent then failed, was scored as a failure of the evaluated version (a wrong 0 in pass@1).
    Now its calls are kept (`Rollout.dropped_turns`, never trained) and checked: the evaluation
    is not scored. A failed run the evaluated weights answered still fails its row."""
    import functools

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings, EvaluationInterrupted
    from grpo_agent.rollout.harness import HarnessRolloutLoop
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.types import TurnRecord
    from transformers import AutoTokenizer

    server, url = _serve(type("Routes", (_ControlRoutes,), {}))
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())

    class ScriptedSampler(HarnessRolloutLoop):
        """The real gateway and agent; the label of the answer's weights set by the row."""

        async def generate_one_turn(self, prompt_ids, max_tokens=None):
            label = "default" if "restarted" in self.tokenizer.decode(prompt_ids) else "3"
            ids = tokenizer.encode("done", add_special_tokens=False) + [tokenizer.eos_token_id]
            return TurnRecord(list(prompt_ids), ids, [-0.1] * len(ids), finish_reason="stop",
                              weight_versions=[label] * len(ids))

    async def agent(client, row):
        await client.chat.completions.create(model="tiny/Model", messages=row["prompt"])
        raise RuntimeError("the agent's own bug")  # a failed run, after one answered call

    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             vllm_server_base_url=url, vllm_server_timeout=5,
                             max_completion_length=64,
                             chat_template_kwargs={"enable_thinking": False})
    session = EvalSession(functools.partial(ScriptedSampler, agent=agent), config=config,
                          processing_class=tokenizer, reward_funcs=[], settings=EvalSettings(),
                          model_name="tiny/Model", restores=lambda: 0)

    def rows(*words):
        return [{"prompt": [{"role": "user", "content": word}]} for word in words]

    async def main():
        async with session:
            with pytest.raises(EvaluationInterrupted, match=(
                    rf"^The vLLM server at {url} sampled the evaluation of version 3 with "
                    r"weights labelled \['default'\], not \['3'\]")):
                await session.evaluate(rows("fine", "restarted"), 3)
            failed = await session.evaluate(rows("fine"), 3)  # the evaluated weights answered
            assert failed.rows[0].rewards == [None] and failed.metrics["eval/pass@1"] == 0.0
            assert failed.served_versions == {"3"}

    _run_then_stop(server, main)


def test_a_training_agent_run_whose_adapter_the_server_refuses_is_handled_as_the_tool_loops(
        tmp_path, monkeypatch):
    """An agent's call through the harness gateway goes through the loop's refusal handling
    (`AsyncRolloutLoop._adapter_after_refusal`), but in training the run then treated a refusal
    by a running server as the agent's failed run (its 502), a stale excuse from before the
    loop waited out the max_staleness=0 push race: a run whose adapters something unloaded
    went on scoring failed agent runs. Now, as for the tool loop: a restarted server is lost,
    the race finishes on the version the worker learns, any other refusal stops the run naming
    the adapter."""
    import asyncio
    import concurrent.futures
    import functools

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout import loop as loop_module
    from grpo_agent.rollout.harness import HarnessRolloutLoop
    from grpo_agent.rollout.worker import RolloutWorker
    from grpo_agent.sampler.client import SamplerClient
    from grpo_agent.sampler.errors import RequestRejectedError
    from grpo_agent.testing import build_tiny_model
    from transformers import AutoTokenizer

    routes = type("Routes", (_LoraRoutes,), {"adapters": []})
    server, url = _serve(routes)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             vllm_server_base_url=url, vllm_server_timeout=5, max_staleness=0,
                             max_completion_length=64,
                             chat_template_kwargs={"enable_thinking": False})

    async def agent(client, row):
        await client.chat.completions.create(model="tiny/Model", messages=row["prompt"])
        return 1.0

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    loop_cls = functools.partial(HarnessRolloutLoop, agent=agent)
    worker = RolloutWorker(loop_cls, config=config, model_name="tiny/Model", dataset=[],
                           reward_funcs=[], processing_class=tokenizer, lora_name="run")  # not started
    loop = loop_cls(config, "tiny/Model", [], [], tokenizer, [tokenizer.eos_token_id],
                    channels=worker.channels, lora_name="run")
    row = {"prompt": [{"role": "user", "content": "hi"}]}
    executor = concurrent.futures.ThreadPoolExecutor(2)
    monkeypatch.setattr(loop_module, "ADAPTER_ANNOUNCE_WAIT_S", 0.3)

    async def main():
        async with SamplerClient(url, timeout=5) as sampler:
            await loop.connect(sampler, executor)
            await loop.setup()
            try:
                worker.set_model_version(3)
                routes.adapters = []  # restarted: the restore's push has not landed yet
                with pytest.raises(ServerUnreachableError, match="serves none of this run's"):
                    await loop.run_agent_rollout(row)
                routes.adapters = ["run-v4"]  # a push loaded version 4 and unloaded 3 ...
                announce = asyncio.get_running_loop().call_later(0.1, worker.set_model_version, 4)
                _, rollout = await loop.run_agent_rollout(row)  # ... and told the worker after
                announce.cancel()
                assert len(rollout.turns) == 1 and rollout.reward == 1.0
                worker.set_model_version(3)  # nothing announces version 4 this time
                with pytest.raises(RequestRejectedError, match=(
                        rf"^The vLLM server at {url} refused the LoRA adapter 'run-v3' as an "
                        r"unknown model while it still serves this run's run-v4: something "
                        r"unloaded it")):
                    await loop.run_agent_rollout(row)
            finally:
                await loop.close()

    try:
        asyncio.run(main())
    finally:
        executor.shutdown()
        server.shutdown()
        server.server_close()


def test_a_training_rollout_whose_adapter_a_restored_server_serves_again_is_sent_again(tmp_path):
    """A server restarted under a request refuses its adapter; by the time the rollout asks it
    what it serves, the trainer's restore has pushed that adapter again. That was restated as
    a lost server, so the group was dropped and `server_down` raised: the trainer ran a second,
    needless restore (one more restart counted). Now the request is sent again and the group
    goes on; an evaluation, pinned, still counts it as lost."""
    import asyncio
    import io

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.sampler.client import SamplerClient

    requested = []

    class Routes(_LoraRoutes):
        adapters: ClassVar[list[str]] = ["run-v3"]  # the restore's push of version 3 landed
        refuse: ClassVar[list[str]] = []  # refused once each: asked of the server before it

        def do_POST(self):
            if urlparse(self.path).path == "/inference/v1/generate":
                body = self.rfile.read(int(self.headers["Content-Length"]))
                model = json.loads(body)["model"]
                requested.append(model)
                if model in self.refuse:
                    self.refuse.remove(model)
                    return self._reply({"error": {
                        "message": f"The model `{model}` does not exist. Valid aliases: "
                                   f"{self.served}.", "type": "NotFoundError", "param": "model",
                        "code": 404}}, status=404)
                self.rfile = io.BytesIO(body)  # read again by _LoraRoutes
            return super().do_POST()

    server, url = _serve(Routes)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             vllm_server_base_url=url, vllm_server_timeout=5,
                             num_generations=2, max_completion_length=64,
                             share_first_turn_request=False)  # one request per rollout

    worker, loop, engine, slot, executor = _one_turn_lora_engine(config)

    async def main():
        async with SamplerClient(url, timeout=5) as sampler:
            await loop.connect(sampler, executor)
            engine._start_scheduling()
            worker.set_model_version(3)
            Routes.refuse = ["run-v3", "run-v3"]  # both rollouts' first request
            engine._groups_in_flight += 1
            engine._groups_generating += 1
            engine.slots.promise(config.num_generations)
            await engine._run_group(slot, 0)
            assert not worker.channels.server_down.is_set()
            group = engine.score_queue.get_nowait()
            assert group.model_version == 3 and requested == ["run-v3"] * 4
            assert worker.channels.samples.empty()  # nothing dropped

            loop.evaluating = True  # an evaluation of version 3 across the restore
            Routes.refuse = ["run-v3"]
            with pytest.raises(recovery.AdapterServedAgain, match=(
                    r"The model `run-v3` does not exist\. Valid aliases: tiny/Model\. \(the "
                    r"server now serves it again: it was restarted, and the trainer's restore "
                    r"pushed the adapter again\)")):
                await loop.generate_one_turn([5, 6])

    try:
        asyncio.run(main())
    finally:
        executor.shutdown()
        server.shutdown()
        server.server_close()
