"""Weight sync against servers that cannot take the push: clear errors, no hangs."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from grpo_agent.sampler import ServerUnreachableError, WeightSyncError
from grpo_agent.weight_sync.transports import build_weight_sync
from grpo_agent.weight_sync.transports.gloo import RENDEZVOUS_THREAD


class NoTransferEngineHandler(BaseHTTPRequestHandler):
    """A server whose workers have no weight-transfer engine (vLLM answers 500)."""

    def do_GET(self):
        self._reply(200, {"world_size": 1})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._reply(500, {"error": {"message": "Weight transfer not configured."}})

    def _reply(self, status, body):
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_gloo_push_to_a_server_without_the_engine_fails_fast_and_says_why():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoTransferEngineHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sync = build_weight_sync(f"http://127.0.0.1:{httpd.server_address[1]}", backend="gloo",
                             timeout=60)
    began = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="(?s)refused to start gloo.*not configured"):
            sync.push([("w", torch.zeros(4))], version=1)
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
