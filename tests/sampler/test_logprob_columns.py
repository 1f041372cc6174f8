"""The generate answer's log-probs as columns (`vllm_answer`, asked for by the client's
`x-grpo-agent-logprobs: columns`): the same values as vLLM's own answer, through vLLM's own
route and answer-building code, read by the client into the same records as vLLM's form."""
import asyncio
import inspect
import json
import math
from types import SimpleNamespace

import httpx
import msgspec
import pytest
from grpo_agent.sampler import SamplerClient, SamplerError, SamplingParams
from grpo_agent.sampler.client import (
    LOGPROB_COLUMNS_ENV,
    _turn_from_generate,
    generate_body,
    logprob_columns_wanted,
)
from grpo_agent.sampler.generate_wire import decode_generate
from grpo_agent.sampler.vllm_answer import (
    ANSWER_HEADER,
    COLUMNS,
    LOGPROB_FLOOR,
    LOGPROBS_HEADER,
    logprob_columns,
    msgspec_json_response,
    serve_tokens_asking_columns,
    tokens_logprobs,
)
from starlette.requests import Request
from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
from vllm.entrypoints.scale_out.token_in_token_out import api_router, serving
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams as VllmSamplingParams

from .test_vllm_answer import VLLM_OWN, engine_logprobs

ROUTE = inspect.unwrap(api_router.generate)  # vLLM's route body, without its HTTP decorators
VLLM_JSON_RESPONSE = api_router.JSONResponse
assert VLLM_JSON_RESPONSE.__name__ == "JSONResponse"  # not our patch from a plugin load
FULL_GENERATOR = serving.ServingTokens.serve_tokens_full_generator


def content_from_columns(token_ids, columns) -> list[dict]:
    """vLLM's `content` rebuilt from the columns: what the test compares against vLLM's dump."""
    return [{"token_id": token_id, "logprob": logprob, "rank": rank,
             "top_logprobs": [{"token_id": i, "logprob": v, "rank": r}
                              for i, v, r in zip(ids, values, ranks)]}
            for token_id, logprob, rank, ids, values, ranks in zip(
                token_ids, columns["sampled_logprobs"], columns["sampled_ranks"],
                columns["top_ids"], columns["top_logprobs"], columns["top_ranks"])]


def odd_engine_logprobs(seed: int, positions: int, k: int):
    """`engine_logprobs`, and a NaN sampled token that the engine ranks 0 (sent as no rank)."""
    token_ids, steps = engine_logprobs(seed, positions, k)
    steps[6][token_ids[6]] = Logprob(logprob=math.nan, rank=0, decoded_token=None)
    return token_ids, steps


@pytest.mark.parametrize("k", [None, -1, 0, 1, 8])
def test_the_columns_carry_vllms_values(k):
    token_ids, steps = odd_engine_logprobs(seed=3, positions=40, k=8)
    columns = logprob_columns(token_ids, steps, k, serving._clamp_logprob)
    theirs = VLLM_OWN(None, token_ids, steps, k).model_dump()["content"]
    # through JSON: an int log-prob must go out as a float, as vLLM's float field makes it
    ours = content_from_columns(token_ids, json.loads(msgspec.json.encode(columns)))
    assert ours == json.loads(json.dumps(theirs))
    assert all(type(c["logprob"]) is float for p in ours for c in p["top_logprobs"])
    assert ours[4] == {"token_id": 50_001, "logprob": LOGPROB_FLOOR, "rank": None,
                       "top_logprobs": []}  # no entry for the sampled token
    assert ours[5]["logprob"] == LOGPROB_FLOOR  # a position without log-probs
    assert ours[6]["logprob"] == LOGPROB_FLOOR and ours[6]["rank"] is None
    assert ours[1]["logprob"] == LOGPROB_FLOOR  # -inf
    if k in (-1, 8):
        assert ours[2]["top_logprobs"][1]["logprob"] == LOGPROB_FLOOR  # NaN
    assert len(ours[0]["top_logprobs"]) == {None: 0, -1: 9, 0: 1, 1: 1, 8: 8}[k]


class FakeServing(serving.ServingTokens):
    """vLLM's ServingTokens with only what its full answer builder reads; `serve_tokens` hands
    scripted engine outputs to vLLM's own `serve_tokens_full_generator`."""

    def __init__(self, outputs):
        self.outputs, self.enable_prompt_tokens_details = outputs, False
        self.enable_log_outputs, self.request_logger = False, None

    async def serve_tokens(self, request, raw_request=None):
        async def results():
            yield RequestOutput("r", None, list(request.token_ids), None, self.outputs, True)

        if request.stream:
            return self.serve_tokens_stream_generator(
                request, results(), "r", "tiny", RequestResponseMetadata(request_id="r"))
        return await self.serve_tokens_full_generator(
            request, results(), "r", "tiny", RequestResponseMetadata(request_id="r"))


def patched_serving(outputs):
    class Patched(FakeServing):
        _create_tokens_logprobs = tokens_logprobs
        serve_tokens = serve_tokens_asking_columns(FakeServing.serve_tokens)

    return Patched(outputs)


def engine_outputs(n: int, k: int):
    outputs = []
    for i in range(n):
        token_ids, steps = odd_engine_logprobs(seed=11 + i, positions=24, k=k)
        outputs.append(CompletionOutput(index=i, text="", token_ids=token_ids,
                                        cumulative_logprob=None, logprobs=steps,
                                        finish_reason="length"))
    return outputs


def answer(handler, json_response, logprobs, *, headers=(), stream=False):
    """vLLM's route body answering one request through `handler`, as the server would; a
    stream's chunks are read in the same task (where a columns request's state lives)."""
    request = GenerateRequest(token_ids=[1, 2, 3], stream=stream,
                              sampling_params=VllmSamplingParams(n=3, logprobs=logprobs))
    scope = {"type": "http", "method": "POST", "path": "/inference/v1/generate",
             "headers": [(name.encode(), value.encode()) for name, value in headers],
             "app": SimpleNamespace(state=SimpleNamespace(serving_tokens=handler))}

    async def run():
        original = api_router.JSONResponse
        api_router.JSONResponse = json_response
        try:
            response = await ROUTE(request, Request(scope))
            if stream:
                return [chunk async for chunk in response.body_iterator]
            return response
        finally:
            api_router.JSONResponse = original

    return asyncio.run(run())


ASK = [(LOGPROBS_HEADER, COLUMNS)]
FAST = msgspec_json_response(VLLM_JSON_RESPONSE)


@pytest.mark.parametrize("logprobs", [0, 1, 9])
def test_the_route_answers_columns_with_vllms_values_and_only_when_asked(logprobs):
    outputs = engine_outputs(3, k=9)
    theirs = answer(FakeServing(outputs), VLLM_JSON_RESPONSE, logprobs)
    columns = answer(patched_serving(outputs), FAST, logprobs, headers=ASK)
    plain = answer(patched_serving(outputs), FAST, logprobs)
    assert columns.headers[ANSWER_HEADER] == COLUMNS and plain.headers[ANSWER_HEADER] == "msgspec"
    own, ours = json.loads(theirs.body), json.loads(columns.body)
    for choice in ours["choices"]:
        assert "content" not in choice["logprobs"]
        choice["logprobs"] = {"content": content_from_columns(choice["token_ids"],
                                                              choice["logprobs"])}
    own.pop("created"), ours.pop("created")
    assert ours == own
    # without the header, the bytes of the answer before columns existed: vLLM's dump, msgspec
    before = json.loads(theirs.body)
    before["created"] = json.loads(plain.body)["created"]
    assert plain.body == msgspec.json.encode(before)


def test_a_streamed_or_text_request_keeps_vllms_form():
    outputs = engine_outputs(3, k=9)
    handler = patched_serving(outputs)
    chunks = answer(handler, FAST, 9, headers=ASK, stream=True)
    choices = [json.loads(chunk.removeprefix("data: "))["choices"] for chunk in chunks[:-1]]
    assert len(choices) == 3 and all(c[0]["logprobs"]["content"] for c in choices)


def test_a_route_built_another_way_fails_loudly():
    outputs = engine_outputs(2, k=9)

    class Reordered(FakeServing):
        _create_tokens_logprobs = tokens_logprobs
        serve_tokens = serve_tokens_asking_columns(FakeServing.serve_tokens)

        async def serve_tokens_full_generator(self, *args):
            response = await FULL_GENERATOR(self, *args)
            response.choices[1].logprobs = None  # a vLLM that builds one more or one less
            return response

    with pytest.raises(RuntimeError, match="1 placeholders among 2 choices"):
        answer(Reordered(outputs), FAST, 9, headers=ASK)


@pytest.mark.parametrize("top_k", [0, 1, 8])
def test_the_client_builds_the_same_records_from_both_forms(top_k):
    outputs = engine_outputs(3, k=9)
    logprobs = top_k + 1 if top_k else 0
    own = decode_generate(answer(FakeServing(outputs), VLLM_JSON_RESPONSE, logprobs).body, "u")
    columns = decode_generate(answer(patched_serving(outputs), FAST, logprobs, headers=ASK).body,
                              "u")
    assert columns.choices[0].logprobs.content is None
    params = SamplingParams(max_tokens=24, num_logprobs=top_k)
    for a, b in zip(own.choices, columns.choices, strict=True):
        theirs, ours = _turn_from_generate([1], a, params), _turn_from_generate([1], b, params)
        assert ours == theirs
        assert LOGPROB_FLOOR in ours.output_log_probs and len(ours.output_log_probs) == 24
        if top_k:
            assert min(len(top) for top in ours.output_sampler_logprobs[:4]) >= top_k


def test_columns_of_the_wrong_length_fail_naming_the_server():
    outputs = engine_outputs(1, k=9)
    body = json.loads(answer(patched_serving(outputs), FAST, 9, headers=ASK).body)
    body["choices"][0]["logprobs"]["top_ranks"].pop()
    choice = decode_generate(json.dumps(body).encode(), "u").choices[0]
    with pytest.raises(SamplerError, match="http://x/inference/v1/generate answered log-prob"):
        _turn_from_generate([1], choice, SamplingParams(max_tokens=24, num_logprobs=8),
                            "http://x/inference/v1/generate")


def test_the_client_asks_for_columns_unless_told_not_to(monkeypatch):
    outputs = engine_outputs(1, k=9)
    bodies = {True: answer(patched_serving(outputs), FAST, 9, headers=ASK).body,
              False: answer(FakeServing(outputs), VLLM_JSON_RESPONSE, 9).body}
    seen = []

    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})
        asked = request.headers.get(LOGPROBS_HEADER) == COLUMNS
        seen.append(asked)
        return httpx.Response(200, content=bodies[asked])

    async def turn(**kwargs):
        async with SamplerClient("http://x", **kwargs) as client:
            client._http = httpx.AsyncClient(base_url="http://x",
                                             transport=httpx.MockTransport(reply))
            return await client.generate([1, 2], SamplingParams(max_tokens=24, num_logprobs=8))

    monkeypatch.delenv(LOGPROB_COLUMNS_ENV, raising=False)
    default = asyncio.run(turn())
    monkeypatch.setenv(LOGPROB_COLUMNS_ENV, "0")
    off = asyncio.run(turn())
    explicit = asyncio.run(turn(logprob_columns=True))
    assert seen == [True, False, True]
    assert default == off == explicit
    with pytest.raises(ValueError, match=f"{LOGPROB_COLUMNS_ENV}='maybe'"):
        logprob_columns_wanted({LOGPROB_COLUMNS_ENV: "maybe"})


@pytest.mark.vllm
def test_the_session_server_samples_the_same_values_in_both_forms(vllm_server):
    """A seeded request to the real server, answered in vLLM's form and in columns: the same
    tokens, log-probs and top-k, read by the client and in the raw answers."""
    url = f"{vllm_server.base_url}/inference/v1/generate"
    params = SamplingParams(max_tokens=16, num_logprobs=8, seed=1234, ignore_eos=True)
    body = generate_body(str(vllm_server.model_path), list(range(10, 40)), params)
    plain = httpx.post(url, json=body, timeout=120)
    asked = httpx.post(url, json=body, headers=dict(ASK), timeout=120)
    plain.raise_for_status(), asked.raise_for_status()
    if getattr(vllm_server, "pid", None) is None and ANSWER_HEADER not in asked.headers:
        pytest.skip("an external server without grpo-agent's vLLM plugin")
    assert (plain.headers[ANSWER_HEADER], asked.headers[ANSWER_HEADER]) == ("msgspec", COLUMNS)
    own, ours = plain.json()["choices"][0], asked.json()["choices"][0]
    assert ours["token_ids"] == own["token_ids"] and len(own["token_ids"]) == 16
    assert content_from_columns(ours["token_ids"], ours["logprobs"]) == own["logprobs"]["content"]
    assert all(len(top) == 9 for top in ours["logprobs"]["top_ids"])
    assert all(math.isfinite(v) and v < 0 for v in ours["logprobs"]["sampled_logprobs"])

    async def turns():
        out = []
        for columns in (False, True):
            async with SamplerClient(vllm_server.base_url, timeout=120,
                                     logprob_columns=columns) as client:
                out.append(await client.generate(list(range(10, 40)), params))
        return out

    theirs, mine = asyncio.run(turns())
    assert mine.output_ids == theirs.output_ids == own["token_ids"]
    assert mine.output_log_probs == theirs.output_log_probs
    assert mine.output_sampler_logprobs == theirs.output_sampler_logprobs
    assert all(len(top) == 8 for top in mine.output_sampler_logprobs)
