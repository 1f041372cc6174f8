"""Start-up wait for a vLLM server that is still loading (spec: `vllm_server_timeout` covers
waiting for the server to become ready), against real sockets on localhost.

`LoadingServer` behaves like `vllm serve`: it binds its port at once, but listens (and answers)
only after `delay` seconds, so until then every connection is refused."""
import asyncio
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from grpo_agent.sampler import ServerUnreachableError
from grpo_agent.sampler.readiness import port_state, wait_until_ready
from grpo_agent.train import setup

from tests.stand_in_http import send_reply

GENERATED = {"choices": [{"token_ids": [5], "finish_reason": "length",
                          "weight_versions": [{"version": "default", "start": 0, "end": 1}],
                          "logprobs": {"content": [{"token_id": 5, "logprob": -0.1,
                                                    "top_logprobs": []}]}}]}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/v1/models"):
            self._reply({"data": [{"id": "tiny", "max_model_len": 64}]})
        else:
            self._reply({"model_config": {"dtype": "torch.float32"}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._reply(GENERATED)

    def _reply(self, body):
        send_reply(self, body)

    def log_message(self, *args):
        pass


class LoadingServer:
    def __init__(self, delay: float):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self.httpd.server_bind()  # the port is taken now; connections are refused until listen
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.ready_at = time.monotonic() + delay
        self._timer = threading.Timer(delay, self._start)
        self._timer.start()

    def _start(self):
        self.httpd.server_activate()
        self.serving = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.serving.start()

    def close(self):
        self._timer.cancel()
        if getattr(self, "serving", None) is not None:  # shutdown() waits for serve_forever
            self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def loading_server():
    servers = []
    yield lambda delay: servers.append(LoadingServer(delay)) or servers[-1]
    for server in servers:
        server.close()


def test_server_facts_wait_for_a_server_that_is_still_loading(loading_server, caplog):
    """Loading for 9 s: past the client's own retries (about 8 s), far below the timeout."""
    server = loading_server(9.0)
    caplog.set_level(logging.INFO, logger="grpo_agent.sampler.readiness")
    facts = asyncio.run(setup._server_facts(server.url, 1800.0))
    assert time.monotonic() >= server.ready_at
    assert facts.model_id == "tiny" and facts.max_model_len == 64
    waiting = [r.getMessage() for r in caplog.records if "Waiting for the vLLM server" in r.message]
    assert waiting, caplog.text  # a log line every few seconds: what is awaited, the last error
    assert "of 1800 s" in waiting[0] and "connection refused" in waiting[0]
    assert "held on this machine" in waiting[0]
    first = next(r for r in caplog.records if "Waiting for the vLLM server" in r.message)
    assert first.levelno == logging.WARNING  # the CLI shows warnings only: no silent wait


def test_a_held_port_is_waited_for_past_the_grace_for_free_ports(loading_server):
    server = loading_server(2.5)
    waited = asyncio.run(wait_until_ready(server.url, 60.0, refused_grace_s=0.5))
    assert waited >= 2.0


def test_nothing_listening_on_a_local_port_fails_after_the_grace_not_the_timeout(tmp_path):
    """Without the caller's `start_command` no command is named: a GPU `vllm serve MODEL` was,
    wrong for a CPU machine and for every real model; the docs and the URL setting are."""
    from grpo_agent.cli.failure import report_failure

    port = _free_port()
    assert port_state("127.0.0.1", port) == "free"
    began = time.monotonic()
    with pytest.raises(ServerUnreachableError,
                       match=f"(?s)refused for 2 s.*holds port {port}.*docs/vllm.md, Server flags; "
                             "the model, the run's settings and the server's device are not known "
                             "here.*--vllm-url") as raised:
        asyncio.run(wait_until_ready(f"http://127.0.0.1:{port}", 1800.0, refused_grace_s=2.0))
    assert time.monotonic() - began < 5
    assert raised.value.start_command is None
    assert "vllm serve" not in str(raised.value) and "`" not in str(raised.value)
    message, _ = report_failure(raised.value, tmp_path)
    assert "what to do: check the vLLM server" in message


def test_the_cli_prints_the_whole_command_that_starts_a_server_this_run_accepts(tiny_model_path,
                                                                                 tmp_path):
    """The command outgrew the CLI's 300-character summary line, which cut it mid-flag: the
    advice line carries it whole (its flags are pinned in test_server.py)."""
    from grpo_agent.cli.failure import report_failure
    from grpo_agent.sampler.server_facts import ServerNeeds

    needs = ServerNeeds(model=str(tiny_model_path), max_completion_length=16,
                        num_sampler_logprobs=8, logprobs_per_token=9, trainer_dtype="float32")
    port = _free_port()
    with pytest.raises(ServerUnreachableError) as raised:
        asyncio.run(wait_until_ready(f"http://127.0.0.1:{port}", 1800.0, refused_grace_s=1.0,
                                     start_command=lambda port: setup.serve_command_for(needs, port)))
    command = setup.serve_command_for(needs, port)
    assert f"`{command}`" in str(raised.value)
    message, _ = report_failure(raised.value, tmp_path)
    assert command not in message.splitlines()[0]  # the summary line is cut
    assert f"  what to do: start the server with `{command}` (or pass the right --vllm-url)" in message


def test_the_timeout_bounds_the_wait_and_names_the_setting(loading_server):
    server = loading_server(30.0)
    began = time.monotonic()
    with pytest.raises(ServerUnreachableError, match="not ready after 2 s .vllm_server_timeout.*"
                                                     "connection refused"):
        asyncio.run(wait_until_ready(server.url, 2.0))
    assert time.monotonic() - began < 4


def test_a_server_answering_5xx_is_not_ready():
    """A proxy in front of a loading server answers 503: that is waited on (and named in the
    error), not taken for a ready server whose first generate request would fail."""
    class Unavailable(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ServerUnreachableError, match="not ready after 2 s.*HTTP 503"):
            asyncio.run(wait_until_ready(f"http://127.0.0.1:{httpd.server_address[1]}", 2.0))
    finally:
        httpd.shutdown()
        httpd.server_close()



def _answering(status):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_4xx_answer_is_a_ready_server_left_to_the_callers_request():
    """A server asking for an API key (401) is up: the caller's own request reports the 4xx
    with the server's message, instead of a half-hour wait for a server that is there."""
    httpd = _answering(401)
    try:
        began = time.monotonic()
        asyncio.run(wait_until_ready(f"http://127.0.0.1:{httpd.server_address[1]}", 30.0))
        assert time.monotonic() - began < 5
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_timeout_shorter_than_a_poll_is_not_overslept():
    httpd = _answering(503)
    try:
        began = time.monotonic()
        with pytest.raises(ServerUnreachableError, match="HTTP 503"):
            asyncio.run(wait_until_ready(f"http://127.0.0.1:{httpd.server_address[1]}", 0.2))
        assert time.monotonic() - began < 0.95  # one poll sleeps 1 s
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_host_that_does_not_resolve_fails_at_once():
    began = time.monotonic()
    with pytest.raises(ServerUnreachableError, match="does not resolve.*vllm_server_base_url"):
        asyncio.run(wait_until_ready("http://no-such-host.invalid:8000", 1800.0))
    assert time.monotonic() - began < 15


def test_port_state_tells_held_free_and_remote_apart(loading_server):
    server = loading_server(30.0)
    held_port = server.httpd.server_address[1]
    assert port_state("127.0.0.1", held_port) == "held"
    assert port_state("localhost", held_port) == "held"
    assert port_state("127.0.0.1", _free_port()) == "free"
    assert port_state("192.0.2.1", 8000) == "remote"  # TEST-NET-1: never this machine


class _DiskServerHandler(_Handler):
    """A server without a weight-transfer engine: weight sync writes safetensors (disk)."""

    def do_GET(self):
        self._reply({"vllm_config": {}})


def test_weight_sync_calls_take_vllm_server_timeout(tmp_path):
    from types import SimpleNamespace

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.weight_sync.adapter import AdapterPusher
    from grpo_agent.weight_sync.full import WeightPusher

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _DiskServerHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    args = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_timeout=7.0,
                           vllm_server_base_url=f"http://127.0.0.1:{httpd.server_address[1]}")
    try:
        pusher = WeightPusher(args)
        assert pusher._sync.control._http.timeout.read == 7.0  # merged-weight pushes
        pusher.close()
        with AdapterPusher._control(SimpleNamespace(args=args)) as control:  # adapter loads
            assert control._http.timeout.read == 7.0
    finally:
        httpd.shutdown()
        httpd.server_close()


def _scripted_server(monkeypatch, answer):
    """`wait_until_ready` against `answer(request)` (an `httpx.Response`, or an error to raise)
    instead of the network."""
    from grpo_agent.sampler import readiness

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=httpx.MockTransport(answer), **kwargs))
    monkeypatch.setattr(readiness, "POLL_S", 0.02)


def _refused(request):
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


@pytest.mark.parametrize("between", ["held port", "HTTP 503", "read timeout"])
def test_the_grace_for_a_free_port_counts_one_unbroken_stretch_of_refusals(monkeypatch, between):
    """Refused on a free port for 0.9 s, then a sign of a server coming up (its port held, a
    503, a slow answer), then refused for 0.9 s again: each stretch is within the 1.5 s grace,
    so the wait goes on to the ready server instead of adding the stretches up."""
    from grpo_agent.sampler import readiness

    stretch_s, stage = 0.9, {"began": time.monotonic(), "held": False}

    def answer(request):
        elapsed = time.monotonic() - stage["began"]
        if "between_at" not in stage:
            if elapsed < stretch_s:
                return _refused(request)
            stage["between_at"] = time.monotonic()
            if between == "HTTP 503":
                return httpx.Response(503)
            if between == "read timeout":
                raise httpx.ReadTimeout("timed out", request=request)
            stage["held"] = True
            return _refused(request)
        if time.monotonic() - stage["between_at"] < stretch_s:
            return _refused(request)
        return httpx.Response(200, json={"data": []})

    def port_state(host, port):
        held, stage["held"] = stage["held"], False
        return "held" if held else "free"

    _scripted_server(monkeypatch, answer)
    monkeypatch.setattr(readiness, "port_state", port_state)
    waited = asyncio.run(wait_until_ready("http://127.0.0.1:8000", 30.0, refused_grace_s=1.5))
    assert waited >= 2 * stretch_s


def test_an_https_url_without_a_port_is_probed_on_443(monkeypatch):
    from grpo_agent.sampler import readiness

    probed = []
    _scripted_server(monkeypatch, _refused)
    monkeypatch.setattr(readiness, "port_state", lambda host, port: probed.append(port) or "free")
    with pytest.raises(ServerUnreachableError, match="holds port 443"):
        asyncio.run(wait_until_ready("https://127.0.0.1", 30.0, refused_grace_s=0))
    assert set(probed) == {443}
