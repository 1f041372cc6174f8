"""The generate answer built in one validation and encoded by msgspec inside vLLM's API server
(`vllm_answer`): the same answer as vLLM's own code, installed only where it applies."""
import json
import math
import random

import httpx
import pytest
from grpo_agent.sampler import vllm_answer
from grpo_agent.sampler.vllm_answer import (
    ANSWER_HEADER,
    FAST_ANSWER_ENV,
    install,
    tokens_logprobs,
    wanted,
)
from vllm.entrypoints.scale_out.token_in_token_out import api_router, serving
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.logprobs import FlatLogprobs, Logprob

VLLM_OWN = serving.ServingTokens._create_tokens_logprobs
# The reference must be vLLM's own code, not our patch installed by a plugin load in this process.
assert VLLM_OWN is not tokens_logprobs and VLLM_OWN.__module__ == serving.__name__


def engine_logprobs(seed: int, positions: int, k: int):
    """Token ids and per-position {id: Logprob} maps as vLLM's output processor keeps them: the
    sampled token first (with its rank), then the top-k; some positions with odd values."""
    gen = random.Random(seed)
    token_ids, steps = [], []
    for position in range(positions):
        ids = gen.sample(range(50_000), k + 1)
        values = [-gen.random() * 20 for _ in ids]
        if position == 1:
            values[0] = -math.inf  # the floor
        if position == 2:
            values[1] = math.nan
        if position == 3:
            values[2] = 0  # an int log-prob
        step = {t: Logprob(logprob=v, rank=gen.randint(1, 60) if i == 0 else i, decoded_token=None)
                for i, (t, v) in enumerate(zip(ids, values))}
        sampled = ids[0]
        if position == 4:
            sampled = 50_001  # no entry for the sampled token
        if position == 5:
            step = None
        token_ids.append(sampled)
        steps.append(step)
    return token_ids, steps


@pytest.mark.parametrize("k", [None, -1, 0, 1, 8])
def test_the_log_probs_dump_exactly_as_vllms_own(k):
    token_ids, steps = engine_logprobs(seed=3, positions=40, k=8)
    ours = tokens_logprobs(None, token_ids, steps, k).model_dump()
    theirs = VLLM_OWN(None, token_ids, steps, k).model_dump()
    assert ours == theirs
    assert ours["content"][4] == {"token_id": 50_001, "logprob": -9999.0, "rank": None,
                                  "top_logprobs": []}
    if k == 8:
        assert [len(p["top_logprobs"]) for p in ours["content"][:4]] == [8, 8, 8, 8]


def test_flat_storage_reads_the_same():
    token_ids, steps = engine_logprobs(seed=5, positions=12, k=8)
    steps = [s for s in steps if s is not None]
    flat = FlatLogprobs()
    flat.extend(steps)
    token_ids = token_ids[: len(steps)]
    assert (tokens_logprobs(None, token_ids, flat, 8).model_dump()
            == VLLM_OWN(None, token_ids, flat, 8).model_dump())


def test_the_answer_body_reads_back_to_the_same_values():
    token_ids, steps = engine_logprobs(seed=7, positions=64, k=9)
    steps[5] = steps[6]  # keep every position populated
    choices = [GenerateTokensChoice(index=i, token_ids=token_ids, finish_reason="length",
                                    logprobs=tokens_logprobs(None, token_ids, steps, 9))
               for i in range(3)]
    content = GenerateTokensResponse(request_id="r", choices=choices).model_dump()
    theirs = api_router.JSONResponse(content=content).body
    fast = vllm_answer.msgspec_json_response(api_router.JSONResponse)(content=content)
    assert fast.headers["content-type"] == "application/json"
    assert fast.headers[ANSWER_HEADER] == "msgspec"
    assert json.loads(fast.body) == json.loads(theirs)


def test_the_switch_is_read_from_the_environment():
    assert wanted({}) and wanted({FAST_ANSWER_ENV: "1"}) and not wanted({FAST_ANSWER_ENV: "0"})
    with pytest.raises(ValueError, match=f"{FAST_ANSWER_ENV}='maybe'"):
        wanted({FAST_ANSWER_ENV: "maybe"})


def test_install_patches_the_api_server_only_and_leaves_other_shapes_alone(monkeypatch, caplog):
    monkeypatch.setattr(serving.ServingTokens, "_create_tokens_logprobs", VLLM_OWN)
    monkeypatch.setattr(api_router, "JSONResponse", api_router.JSONResponse)
    serve = serving.ServingTokens.serve_tokens
    monkeypatch.setattr(serving.ServingTokens, "serve_tokens", serve)
    assert not install({FAST_ANSWER_ENV: "0"})
    assert serving.ServingTokens._create_tokens_logprobs is VLLM_OWN

    monkeypatch.setattr(vllm_answer, "is_api_server_process", lambda: False)  # engine core
    assert not install({})
    assert serving.ServingTokens._create_tokens_logprobs is VLLM_OWN

    monkeypatch.setattr(vllm_answer, "is_api_server_process", lambda: True)
    monkeypatch.setattr(serving.ServingTokens, "_create_tokens_logprobs",
                        lambda self, token_ids, top_logprobs, k, tokenizer=None: None)
    assert not install({})  # another vLLM's signature: a warning, nothing patched
    assert "not the shape" in caplog.text
    monkeypatch.setattr(serving.ServingTokens, "_create_tokens_logprobs", VLLM_OWN)

    async def serve_tokens(self, request):  # no raw request: no header to read
        pass

    monkeypatch.setattr(serving.ServingTokens, "serve_tokens", serve_tokens)
    caplog.clear()
    assert not install({}) and "not the shape" in caplog.text
    assert serving.ServingTokens._create_tokens_logprobs is VLLM_OWN
    monkeypatch.setattr(serving.ServingTokens, "serve_tokens", serve)

    import builtins

    real_import = builtins.__import__

    def no_generate_route(name, *args, **kwargs):  # an older vLLM: no scale_out package
        if name.startswith("vllm.entrypoints.scale_out"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(serving.ServingTokens, "_create_tokens_logprobs", VLLM_OWN)
    monkeypatch.setattr(builtins, "__import__", no_generate_route)
    assert not install({})  # the server still starts
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert install({}) and install({})  # twice: the second sees its own patch
    assert serving.ServingTokens._create_tokens_logprobs is tokens_logprobs
    assert serving.ServingTokens.serve_tokens.__wrapped__ is serve  # wrapped once
    assert api_router.JSONResponse.__name__ == "MsgspecJSONResponse"
    assert api_router.JSONResponse.__mro__[1].__name__ == "JSONResponse"  # wrapped once


@pytest.mark.vllm
def test_the_session_server_answers_through_the_patch(vllm_server):
    """vLLM loads the plugin in its API server too, and the generate route answers through it
    (the log-prob tests of test_vllm_sampling.py check the values it carries)."""
    body = {"model": str(vllm_server.model_path), "token_ids": [5, 6, 7],
            "sampling_params": {"max_tokens": 3, "logprobs": 3, "detokenize": False}}
    response = httpx.post(f"{vllm_server.base_url}/inference/v1/generate", json=body, timeout=120)
    response.raise_for_status()
    if getattr(vllm_server, "pid", None) is None and ANSWER_HEADER not in response.headers:
        pytest.skip("an external server without grpo-agent's vLLM plugin")
    assert response.headers[ANSWER_HEADER] == "msgspec"
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(p["top_logprobs"]) == 3 for p in content)
