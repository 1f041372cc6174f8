"""Weight sync against servers that cannot take the push: clear errors, no hangs."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from grpo_agent.sampler import ServerUnreachableError, WeightSyncError
from grpo_agent.sampler.errors import RequestRejectedError, SamplerError, retry_delay_s
from grpo_agent.weight_sync.transports import build_weight_sync
from grpo_agent.weight_sync.transports import control as control_module
from grpo_agent.weight_sync.transports.control import ServerControl, start_update
from grpo_agent.weight_sync.transports.gloo import RENDEZVOUS_THREAD

from tests.stand_in_http import send_reply


class NoTransferEngineHandler(BaseHTTPRequestHandler):
    """A server whose workers have no weight-transfer engine (vLLM answers 500)."""

    def do_GET(self):
        self._reply(200, {"world_size": 1})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._reply(500, {"error": {"message": "Weight transfer not configured."}})

    def _reply(self, status, body):
        send_reply(self, body, status)

    def log_message(self, *args):
        pass


def test_gloo_push_to_a_server_without_the_engine_fails_fast_and_says_why():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoTransferEngineHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sync = build_weight_sync(f"http://127.0.0.1:{httpd.server_address[1]}", backend="gloo",
                             timeout=60)
    began = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="(?s)refused to start gloo.*not configured") as err:
            sync.push([("w", torch.zeros(4))], version=1)
        # The advice names what a user sets, the server's flag (the transport follows it); not
        # backend='disk', which no trainer option takes.
        assert str(err.value).endswith(
            "Start the server on the trainer's machine with --weight-transfer-config "
            "'{\"backend\": \"gloo\"}', or without --weight-transfer-config to have the trainer "
            "write the weights to a folder the server reloads (disk).")
    finally:
        sync.close()
        httpd.shutdown()
        httpd.server_close()
    assert time.monotonic() - began < 20
    # the trainer's end of the rendezvous was released, not left waiting out the timeout
    assert not [t for t in threading.enumerate() if t.name == RENDEZVOUS_THREAD]


def test_push_to_nothing_listening_names_the_url():
    sync = build_weight_sync("http://127.0.0.1:9", backend="disk", timeout=10)
    try:
        with pytest.raises(ServerUnreachableError, match="127.0.0.1:9"):
            sync.push([("w", torch.zeros(4))], version=1)
    finally:
        sync.close()


def _control(handler, base_url="http://server:8000/"):
    """The real control client over a fake HTTP seam: `handler(request)` -> httpx.Response."""
    control = ServerControl(base_url, timeout=5)
    control._http = httpx.Client(base_url=control.base_url, transport=httpx.MockTransport(handler))
    return control


def test_a_4xx_is_a_rejection_that_names_the_route_and_the_servers_message():
    with _control(lambda request: httpx.Response(400, text="bad version")) as control, pytest.raises(RequestRejectedError) as raised:
        control.set_version(3)
    assert raised.value.status_code == 400
    assert "POST http://server:8000/update_weight_version failed with HTTP 400: bad version" \
        in str(raised.value)


def test_a_missing_control_route_names_vllm_server_dev_mode():
    """A server started without VLLM_SERVER_DEV_MODE=1 answers its control routes with a bare
    404; seen as the trainer's first push failing with only 'Not Found'."""
    missing = httpx.Response(404, json={"detail": "Not Found"})
    with _control(lambda request: missing) as control, pytest.raises(RequestRejectedError) as raised:
        control.call("POST", "/collective_rpc", json_body={"method": "reload_weights"})
    assert "HTTP 404" in str(raised.value) and "VLLM_SERVER_DEV_MODE=1" in str(raised.value)
    unknown = httpx.Response(404, json={"detail": "adapter x not found"})  # a route's own 404
    with _control(lambda request: unknown) as control, pytest.raises(RequestRejectedError) as raised:
        control.call("POST", "/v1/unload_lora_adapter", json_body={"lora_name": "x"})
    assert "VLLM_SERVER_DEV_MODE" not in str(raised.value)


def test_a_refused_prefix_cache_reset_fails_the_push():
    with _control(lambda request: httpx.Response(200, json={"success": False})) as control, pytest.raises(WeightSyncError, match="refused to reset its prefix cache"):
        control.reset_prefix_cache()


def test_an_update_left_open_is_closed_then_reopened_and_other_refusals_raise():
    paths = []

    def left_open(request):
        paths.append(request.url.path)
        if len(paths) == 1:
            return httpx.Response(400, text="Weight update already active")
        return httpx.Response(200, json={})

    with _control(left_open) as control:
        start_update(control)
    assert paths == ["/start_weight_update", "/finish_weight_update", "/start_weight_update"]
    with _control(lambda request: httpx.Response(500, text="engine died")) as control, pytest.raises(RequestRejectedError, match="engine died"):
        start_update(control)


def test_lora_routes_retry_5xx_twice_and_fail_a_4xx_at_once(monkeypatch):
    slept = []
    monkeypatch.setattr(control_module.time, "sleep", slept.append)
    calls = []

    def busy(request):
        calls.append(json.loads(request.content))
        return httpx.Response(503, text="busy")

    with _control(busy) as control, pytest.raises(SamplerError, match="busy"):
        control.load_lora_adapter("v3", "/tmp/adapters/v3")
    assert calls == [{"lora_name": "v3", "lora_path": "/tmp/adapters/v3"}] * 3
    assert slept == [retry_delay_s(1), retry_delay_s(2)]
    calls.clear()

    def missing(request):
        calls.append(request.url.path)
        return httpx.Response(404, text="no such adapter")

    with _control(missing) as control, pytest.raises(RequestRejectedError):
        control.unload_lora_adapter("v3")
    assert calls == ["/v1/unload_lora_adapter"]


def test_served_models_lists_the_base_model_then_the_adapters():
    data = {"data": [{"id": "base"}, {"id": "v1"}, {"id": "v2"}]}
    with _control(lambda request: httpx.Response(200, json=data)) as control:
        assert control.served_models() == ["base", "v1", "v2"]
