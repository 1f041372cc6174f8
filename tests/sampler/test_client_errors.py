"""The client's failure modes against small real HTTP servers (no vLLM needed).

Each server is a real socket on localhost, scripted to answer the way a broken or strict vLLM
would: refuse connections, answer 4xx, answer 5xx then recover, or die mid-request.
"""
import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from grpo_agent.sampler import (
    RequestRejectedError,
    SamplerClient,
    SamplerError,
    SamplingParams,
    ServerUnreachableError,
)
from grpo_agent.sampler.client import NO_GENERATE_WARNED_ENV

from tests.stand_in_http import send_reply

MODELS = {"object": "list", "data": [{"id": "tiny", "max_model_len": 64}]}


@pytest.fixture(autouse=True)
def _no_route_warned_yet(monkeypatch):
    """Each test starts with no URL warned about, and leaves none behind for later tests (or
    the processes they spawn)."""
    monkeypatch.setenv(NO_GENERATE_WARNED_ENV, "")


class ScriptedServer:
    """Answers POSTs from a queue of (status, body) pairs; GET /v1/models always works."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.posts = 0
        self.bodies = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._reply(200, MODELS)

            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                outer.posts += 1
                self._reply(*outer.replies.pop(0))

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


GENERATED = {"choices": [{"token_ids": [7, 8], "finish_reason": "length",
                          "weight_versions": [{"version": "3", "start": 0, "end": 2}],
                          "logprobs": {"content": [
                              {"token_id": 7, "logprob": -0.5, "top_logprobs": [
                                  {"token_id": 7, "logprob": -0.5, "rank": 2},
                                  {"token_id": 9, "logprob": -0.2, "rank": 1},
                                  {"token_id": 4, "logprob": -3.0, "rank": 3}]},
                              {"token_id": 8, "logprob": -0.1, "top_logprobs": [
                                  {"token_id": 8, "logprob": -0.1, "rank": 1},
                                  {"token_id": 5, "logprob": -2.5, "rank": 2},
                                  {"token_id": 6, "logprob": -2.7, "rank": 3}]}]}}]}


def _generate(url, **client_kwargs):
    async def run():
        async with SamplerClient(url, **client_kwargs) as client:
            turn = await client.generate([1, 2, 3], SamplingParams(max_tokens=2, num_logprobs=2))
            return turn, client.retry_count
    return asyncio.run(run())


def test_generate_parses_ids_logprobs_top_k_and_weight_versions():
    server = ScriptedServer([(200, GENERATED)])
    try:
        turn, retries = _generate(server.url)
    finally:
        server.close()
    assert turn.output_ids == [7, 8] and turn.output_log_probs == [-0.5, -0.1]
    # k+1 were asked for; only the true top-2 survive, sampled or not.
    assert turn.output_sampler_logprobs == [{9: -0.2, 7: -0.5}, {8: -0.1, 5: -2.5}]
    assert turn.weight_versions == ["3", "3"] and turn.finish_reason == "length"
    assert retries == 0
    # Ids only: the server's API process would otherwise decode every sampled token and each of
    # its top-k (255 -> 110-152 ms of its CPU per 1,000 tokens measured with top-9 on CPU).
    assert server.bodies[0]["sampling_params"]["detokenize"] is False
    assert server.bodies[0]["sampling_params"]["logprobs"] == 3


# vLLM 0.32's full answer: fields the client never reads (token, bytes, stop_reason, usage, ...),
# an integer log-prob, the -9999.0 floor it puts in place of -inf, a sampled token outside the
# top-2 (rank 5) and choices out of index order.
FULL_WIRE = {"id": "gen-1", "created": 1, "model": "tiny", "usage": {"prompt_tokens": 3},
             "choices": [
                 {"index": 1, "token_ids": [4], "finish_reason": "stop", "stop_reason": None,
                  "routed_experts": None, "sampling_mask": None, "weight_versions": None,
                  "logprobs": {"content": [
                      {"token_id": 4, "logprob": -9999.0, "token": "", "bytes": None, "rank": 5,
                       "top_logprobs": [
                           {"token_id": 4, "logprob": -9999.0, "rank": 5, "token": ""},
                           {"token_id": 1, "logprob": 0, "rank": 1, "token": ""},
                           {"token_id": 2, "logprob": -3.25, "rank": 2, "token": ""},
                           {"token_id": 3, "logprob": -4.5, "rank": 3, "token": ""}]}]}},
                 {"index": 0, "token_ids": [9, 8], "finish_reason": "length",
                  "weight_versions": [{"version": "7", "start": 0, "end": 1},
                                      {"version": "8", "start": 1, "end": 2}],
                  "logprobs": {"content": [
                      {"token_id": 9, "logprob": -0.125, "top_logprobs": [
                          {"token_id": 9, "logprob": -0.125, "rank": 1},
                          {"token_id": 5, "logprob": -2.0, "rank": 2},
                          {"token_id": 6, "logprob": -2.5, "rank": 3}]},
                      {"token_id": 8, "logprob": -1.5, "top_logprobs": [
                          {"token_id": 8, "logprob": -1.5, "rank": 3},
                          {"token_id": 3, "logprob": -0.5, "rank": 1},
                          {"token_id": 2, "logprob": -1.0, "rank": 2}]}]}}]}


def _read_plainly(choice: dict, top_k: int) -> dict:
    """What the answer says, read with the json module: the reference for the typed decode."""
    content = choice["logprobs"]["content"]
    spans = choice.get("weight_versions") or []
    return {
        "output_ids": choice["token_ids"],
        "output_log_probs": [float(entry["logprob"]) for entry in content],
        "output_sampler_logprobs": [
            {top["token_id"]: float(top["logprob"]) for top in entry["top_logprobs"]
             if top["rank"] <= top_k} for entry in content],
        "finish_reason": choice["finish_reason"],
        "weight_versions": [str(span["version"]) for span in spans
                            for _ in range(span["start"], span["end"])] or None,
    }


def test_generate_reads_vllms_full_answer_as_the_json_says():
    """The typed decode (sampler/generate_wire.py) keeps every value the client reads, in
    choice-index order, and skips the rest."""
    server = ScriptedServer([(200, json.dumps(FULL_WIRE).encode())])

    async def run():
        async with SamplerClient(server.url) as client:
            return await client.generate_many([1, 2, 3], SamplingParams(max_tokens=2, num_logprobs=2), 2)
    try:
        turns = asyncio.run(run())
    finally:
        server.close()
    expected = [_read_plainly(choice, 2) for choice in sorted(FULL_WIRE["choices"], key=lambda c: c["index"])]
    got = [{key: getattr(turn, key) for key in expected[0]} for turn in turns]
    assert got == expected
    assert all(isinstance(value, float) for turn in turns for value in turn.output_log_probs)
    assert turns[1].output_sampler_logprobs == [{1: 0.0, 2: -3.25}]  # the rank-5 sample dropped


def test_a_body_that_is_not_a_generate_answer_names_the_url_and_the_field():
    """A proxy or another server that answers 200 with some other JSON fails at once, naming
    what did not match, instead of a KeyError deep in the rollout."""
    server = ScriptedServer([(200, {"choices": [{"index": 0, "token_ids": "7 8"}]})])
    try:
        with pytest.raises(SamplerError, match=r"inference/v1/generate.*token_ids.*--enable-scale-out"):
            _generate(server.url)
    finally:
        server.close()
    assert server.posts == 1  # not retried: the same server would answer the same


def test_fewer_choices_than_requested_samples_is_an_error_naming_both():
    """A group's request asks n samples in one call; an answer with fewer choices (another
    server, an old vLLM) must fail loudly, not give the group fewer rollouts than it counts."""
    server = ScriptedServer([(200, GENERATED)])

    async def run():
        async with SamplerClient(server.url) as client:
            return await client.generate_many([1, 2, 3], SamplingParams(max_tokens=2), 2)
    try:
        with pytest.raises(SamplerError, match="answered 1 choices to a request for n=2"):
            asyncio.run(run())
    finally:
        server.close()


def test_the_completions_fallback_also_refuses_fewer_choices_and_n_below_one():
    server = ScriptedServer([(200, COMPLETION)])

    async def run(n):
        async with SamplerClient(server.url, endpoint="completions") as client:
            return await client.generate_many([1, 2, 3], SamplingParams(max_tokens=1), n)
    try:
        with pytest.raises(SamplerError, match="answered 1 choices to a request for n=2"):
            asyncio.run(run(2))
        with pytest.raises(ValueError, match="n=0: ask for at least one completion"):
            asyncio.run(run(0))
    finally:
        server.close()
    assert server.posts == 1


def test_5xx_is_retried_and_counted_then_succeeds():
    server = ScriptedServer([(503, {"error": "busy"}), (500, {"error": "oops"}), (200, GENERATED)])
    try:
        turn, retries = _generate(server.url)
    finally:
        server.close()
    assert turn.output_ids == [7, 8] and retries == 2 and server.posts == 3


def test_4xx_fails_at_once_with_the_servers_message():
    message = "The decoder prompt (length 100) is longer than the maximum model length of 64."
    server = ScriptedServer([(400, {"error": {"message": message}})] * 5)
    try:
        with pytest.raises(RequestRejectedError, match="longer than the maximum model length"):
            _generate(server.url)
    finally:
        server.close()
    assert server.posts == 1


def test_nothing_listening_raises_unreachable_quickly():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(ServerUnreachableError, match=f"127.0.0.1:{port}.*Start one") as raised:
        _generate(f"http://127.0.0.1:{port}", max_retries=2)
    # No partial command: `vllm serve MODEL --enable-scale-out` starts a server the run's
    # checks refuse (no dev mode, no log-prob flags); the run's start check names the whole one.
    assert "vllm serve" not in str(raised.value) and "docs/vllm.md" in str(raised.value)
    assert time.monotonic() - began < 10


def test_server_dying_mid_request_gives_a_clear_error():
    """The server accepts the request, then its process goes away: socket closed, port dead."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def die_on_first_request():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.close()
        listener.close()

    threading.Thread(target=die_on_first_request, daemon=True).start()

    async def run():
        async with SamplerClient(url, max_retries=2) as client:
            await client.server_info()
    with pytest.raises(ServerUnreachableError, match=url):
        asyncio.run(run())


def test_unknown_endpoint_choice_is_rejected():
    with pytest.raises(ValueError, match="endpoint must be"):
        SamplerClient("http://127.0.0.1:1", endpoint="chat")


COMPLETION = {"choices": [{"token_ids": [7], "finish_reason": "stop", "logprobs": {
    "token_logprobs": [-0.5],
    "top_logprobs": [{"token_id:7": -0.5, "token_id:9": -0.2, "token_id:4": -3.0}]}}]}


def test_server_without_scale_out_falls_back_to_completions():
    disabled = {"error": {"message": "Scale-out endpoints are disabled."}}
    server = ScriptedServer([(403, disabled), (200, COMPLETION), (200, COMPLETION)])
    try:
        turn, _ = _generate(server.url)
        again, _ = _generate(server.url, endpoint="completions")
    finally:
        server.close()
    assert turn.output_ids == [7] and turn.output_sampler_logprobs == [{9: -0.2, 7: -0.5}]
    assert turn.weight_versions is None and again.output_ids == [7]
    assert server.posts == 3


def test_unknown_model_is_an_error_not_a_reason_to_fall_back():
    unknown = {"error": {"message": "The model `adapter-3` does not exist."}}
    server = ScriptedServer([(404, unknown), (200, COMPLETION)])
    try:
        with pytest.raises(RequestRejectedError, match="adapter-3"):
            _generate(server.url)
    finally:
        server.close()
    assert server.posts == 1


def test_the_request_carries_every_sampling_setting_under_vllms_names():
    """Each SamplingParams field reaches the server under vLLM's name and meaning: top_k 0
    (off) is vLLM's -1, k top log-probs are asked as k + 1 (so a full top-k survives a sampled
    token outside it), optional fields only when set, `n` only above 1."""
    from grpo_agent.sampler.client import generate_body

    full = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                          repetition_penalty=1.1, num_logprobs=4, seed=3,
                          stop_token_ids=[2, 9], ignore_eos=True)
    assert generate_body("m", (1, 2, 3), full, 4) == {
        "model": "m", "token_ids": [1, 2, 3], "sampling_params": {
            "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
            "repetition_penalty": 1.1, "logprobs": 5, "n": 4, "min_p": 0.05, "seed": 3,
            "ignore_eos": True, "stop_token_ids": [2, 9], "detokenize": False}}
    assert generate_body("m", [4], SamplingParams(max_tokens=7, num_logprobs=0)) == {
        "model": "m", "token_ids": [4], "sampling_params": {
            "max_tokens": 7, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
            "repetition_penalty": 1.0, "logprobs": 0, "detokenize": False}}


def test_the_completions_fallback_sends_the_same_settings():
    server = ScriptedServer([(200, COMPLETION)])
    params = SamplingParams(max_tokens=3, temperature=0.5, top_k=4, num_logprobs=2, seed=1)

    async def run():
        async with SamplerClient(server.url, endpoint="completions") as client:
            return await client.generate([5, 6], params, model="adapter-1")
    try:
        asyncio.run(run())
    finally:
        server.close()
    assert server.bodies == [{"model": "adapter-1", "prompt": [5, 6], "return_token_ids": True,
                              "return_tokens_as_token_ids": True, "max_tokens": 3,
                              "temperature": 0.5, "top_p": 1.0, "top_k": 4,
                              "repetition_penalty": 1.0, "logprobs": 3, "seed": 1}]


def test_greedy_samples_go_out_as_one_request_each():
    """vLLM refuses n > 1 under greedy sampling: n greedy samples are n requests of n=1."""
    server = ScriptedServer([(200, GENERATED)] * 3)

    async def run():
        async with SamplerClient(server.url) as client:
            return await client.generate_many(
                [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0), 3)
    try:
        turns = asyncio.run(run())
    finally:
        server.close()
    assert [turn.output_ids for turn in turns] == [[7, 8]] * 3 and server.posts == 3
    assert all("n" not in body["sampling_params"] for body in server.bodies)


def test_the_sampling_mask_is_kept_only_when_asked_and_versions_stop_at_the_last_token():
    answer = json.loads(json.dumps(GENERATED))
    choice = answer["choices"][0]
    choice["sampling_mask"] = [[7, 9], [8, 5]]
    choice["weight_versions"] = [{"version": 4, "start": 0, "end": 1},
                                 {"version": 5, "start": 1, "end": 6}]  # past the 2 tokens
    server = ScriptedServer([(200, answer)] * 2)

    async def run(keep):
        async with SamplerClient(server.url) as client:
            return await client.generate([1], SamplingParams(max_tokens=2,
                                                             return_sampling_mask=keep))
    try:
        kept, dropped = asyncio.run(run(True)), asyncio.run(run(False))
    finally:
        server.close()
    assert kept.output_sampling_mask == [[7, 9], [8, 5]] and dropped.output_sampling_mask is None
    assert kept.weight_versions == ["4", "5"]


def test_a_bare_404_falls_back_once_and_the_client_stays_on_completions():
    """A server without the route answers FastAPI's bare 404 {"detail": "Not Found"}: the client
    switches to /v1/completions for good (the next request goes there first)."""
    server = ScriptedServer([(404, {"detail": "Not Found"}), (200, COMPLETION), (200, COMPLETION)])

    async def run():
        async with SamplerClient(server.url) as client:
            params = SamplingParams(max_tokens=2, num_logprobs=2)
            return [await client.generate([1, 2], params) for _ in range(2)]
    try:
        turns = asyncio.run(run())
    finally:
        server.close()
    assert [turn.output_ids for turn in turns] == [[7], [7]] and server.posts == 3
    assert ["token_ids" in body for body in server.bodies] == [True, False, False]


def test_requests_in_flight_when_the_route_proves_missing_warn_once(caplog):
    """Every request of the first burst gets the 404; only the one that switches the client to
    /v1/completions warns (the worker starts dozens of rollouts at once)."""
    import httpx

    async def reply(request):
        if request.url.path == "/inference/v1/generate":
            await asyncio.sleep(0.01)  # the burst is all sent before the first 404 is read
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json=COMPLETION)

    async def run():
        async with SamplerClient("http://x") as client:
            client._http = httpx.AsyncClient(base_url="http://x",
                                             transport=httpx.MockTransport(reply))
            params = SamplingParams(max_tokens=2, num_logprobs=2)
            return await asyncio.gather(*(client.generate([1, 2], params, model="m")
                                          for _ in range(3)))
    turns = asyncio.run(run())
    assert [turn.output_ids for turn in turns] == [[7]] * 3
    warned = [r for r in caplog.records if "no /inference/v1/generate" in r.getMessage()]
    assert len(warned) == 1


def test_a_route_less_server_is_warned_about_once_per_url_in_the_run_and_its_spawned_processes(
        caplog):
    """The trainer's start probe and the rollout worker (spawned after it) each find the route
    missing with their own client: one warning per server URL, not one per client."""
    params = SamplingParams(max_tokens=2, num_logprobs=2)
    missing = (404, {"detail": "Not Found"})
    first, second = (ScriptedServer([missing, (200, COMPLETION)] * 3) for _ in range(2))

    async def generate_with_new_clients(url, times):
        for _ in range(times):
            async with SamplerClient(url) as client:
                assert (await client.generate([1, 2], params)).output_ids == [7]
    child = textwrap.dedent(f"""
        import asyncio
        from grpo_agent.sampler import SamplerClient, SamplingParams
        async def main():
            async with SamplerClient({first.url!r}) as client:
                await client.generate([1, 2], SamplingParams(max_tokens=2, num_logprobs=2))
        asyncio.run(main())""")
    try:
        with caplog.at_level("WARNING", logger="grpo_agent.sampler.client"):
            asyncio.run(generate_with_new_clients(first.url, 2))
            asyncio.run(generate_with_new_clients(second.url, 1))  # another server: its own line
        spawned = subprocess.run([sys.executable, "-c", child], check=False, env=os.environ.copy(),
                                 capture_output=True, text=True, timeout=120)
    finally:
        first.close()
        second.close()
    warned = [r.getMessage() for r in caplog.records if "no /inference/v1/generate" in r.getMessage()]
    assert [line.split()[0] for line in warned] == [first.url, second.url]
    assert spawned.returncode == 0, spawned.stderr
    assert first.posts == 6 and "no /inference/v1/generate" not in spawned.stderr


def test_endpoint_generate_never_falls_back():
    disabled = {"error": {"message": "Scale-out endpoints are disabled."}}
    server = ScriptedServer([(403, disabled), (200, COMPLETION)])
    try:
        with pytest.raises(RequestRejectedError, match="Scale-out endpoints are disabled"):
            _generate(server.url, endpoint="generate")
    finally:
        server.close()
    assert server.posts == 1


def test_completions_choices_come_in_index_order_with_the_best_k_top_logprobs():
    """Record i is choice i whatever the order of the answer; the top-k kept are the k most
    likely of the (k + 1) sent, whatever their order in the map."""
    def choice(index, token):
        return {"index": index, "token_ids": [token], "finish_reason": "stop", "logprobs": {
            "token_logprobs": [-0.5],
            "top_logprobs": [{"token_id:4": -3.0, f"token_id:{token}": -0.5, "token_id:9": -0.2}]}}
    server = ScriptedServer([(200, {"choices": [choice(1, 8), choice(0, 7)]})])

    async def run():
        async with SamplerClient(server.url, endpoint="completions") as client:
            return await client.generate_many([1], SamplingParams(max_tokens=1, num_logprobs=2), 2)
    try:
        turns = asyncio.run(run())
    finally:
        server.close()
    assert [turn.output_ids for turn in turns] == [[7], [8]]
    assert [turn.output_log_probs for turn in turns] == [[-0.5], [-0.5]]
    assert [turn.finish_reason for turn in turns] == ["stop", "stop"]
    assert turns[0].output_sampler_logprobs == [{9: -0.2, 7: -0.5}]
    assert turns[1].output_sampler_logprobs == [{9: -0.2, 8: -0.5}]


def test_a_server_without_metrics_gives_none():
    import httpx

    def reply(request):
        if request.url.path == "/metrics":
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, text="vllm:num_requests_running 3\n")

    async def run():
        async with SamplerClient("http://x") as client:
            client._http = httpx.AsyncClient(base_url="http://x",
                                             transport=httpx.MockTransport(reply))
            return await client.metrics(), await client.metrics_text()
    assert asyncio.run(run()) == (None, None)


def test_a_port_held_by_another_program_is_named_as_not_a_vllm_server():
    """`--vllm-url` at a port some other web server holds: the error said only that GET
    /v1/models was rejected with 404, then the other server's HTML page."""
    import httpx

    def reply(request):
        return httpx.Response(404, text="<!DOCTYPE HTML>\n<html><body>Not Found</body></html>")

    async def run():
        async with SamplerClient("http://x") as client:
            client._http = httpx.AsyncClient(base_url="http://x",
                                             transport=httpx.MockTransport(reply))
            return await client.model_info()
    with pytest.raises(RequestRejectedError, match="http://x answers, but not as a vLLM server") as err:
        asyncio.run(run())
    assert err.value.status_code == 404 and "/v1" not in str(err.value).split("port.")[-1]


def test_an_openai_style_url_ending_in_v1_is_told_to_drop_it():
    """`--vllm-url http://host:8000/v1` (the OpenAI convention) asks GET /v1/v1/models: seen
    failing with 'rejected with HTTP 404: Not Found'."""
    import httpx

    async def run():
        async with SamplerClient("http://x:8000/v1") as client:
            client._http = httpx.AsyncClient(base_url="http://x:8000/v1", transport=httpx.MockTransport(
                lambda request: httpx.Response(404, json={"detail": "Not Found"})))
            return await client.model_info()
    with pytest.raises(RequestRejectedError, match=r"without /v1: http://x:8000\.$"):
        asyncio.run(run())


def test_a_position_without_top_logprobs_or_a_candidate_without_rank_still_decodes():
    """vLLM omits `top_logprobs` when none were asked for and `rank` in some versions; neither
    is a malformed answer."""
    from grpo_agent.sampler.generate_wire import decode_generate

    body = json.dumps({"choices": [{"token_ids": [5, 6], "logprobs": {"content": [
        {"logprob": -0.5}, {"logprob": -0.25, "top_logprobs": [{"token_id": 6, "logprob": -0.25}]}]}}]})
    positions = decode_generate(body.encode(), "http://x").choices[0].logprobs.content
    assert positions[0].top_logprobs == [] and positions[1].top_logprobs[0].rank is None


def _all_subclasses(cls):
    return [cls] + [sub for child in cls.__subclasses__() for sub in _all_subclasses(child)]


def test_every_sampler_error_survives_pickle_with_its_fields():
    """Errors cross process boundaries (the worker's to the trainer); `RequestRejectedError`'s
    keyword-only `status_code` once made unpickling fail."""
    import pickle

    from grpo_agent.sampler import errors

    made = {errors.RequestRejectedError: errors.RequestRejectedError(
        "POST /x was rejected with HTTP 400: bad", status_code=400, server_message="bad")}
    classes = _all_subclasses(SamplerError)
    assert errors.RequestRejectedError in classes and len(classes) >= 6
    for cls in classes:
        error = made.get(cls) or cls(f"{cls.__name__} failed\nadvice", reason="what failed")
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is cls
        assert (copy.args, str(copy), copy.reason, vars(copy)) == (error.args, str(error), error.reason, vars(error))
    assert pickle.loads(pickle.dumps(made[errors.RequestRejectedError])).status_code == 400
