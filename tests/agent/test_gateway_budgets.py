"""The gateway's per-rollout budgets, its max_tokens rule and its key check, at the seam: a
Gateway without a server (the end-to-end paths run in test_gateway_vllm.py)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import make_mocked_request
from grpo_agent.rollout.gateway import AgentSession, Gateway, HarnessLimits
from grpo_agent.rollout.gateway_errors import GatewayError


def _gateway(**limits) -> Gateway:
    gateway = Gateway.__new__(Gateway)  # no tokenizer, no server: the rules only
    gateway.limits = HarnessLimits(**limits)
    gateway.sessions = {}
    gateway.loop = SimpleNamespace(config=SimpleNamespace(max_completion_length=256),
                                   model_name="tiny", server=SimpleNamespace(max_model_len=1024))
    return gateway


def _session(calls=0, tokens=0, age_s=0.0) -> AgentSession:
    session = AgentSession(version=0, started=time.monotonic() - age_s)
    session.turns, session.generated_tokens = [object()] * calls, tokens
    return session


@pytest.mark.parametrize("spent,code", [
    ({"calls": 4}, "rollout_call_budget"),
    ({"tokens": 100}, "rollout_token_budget"),
    ({"age_s": 11.0}, "rollout_time_budget"),
])
def test_each_budget_ends_the_rollouts_calls_once_spent(spent, code):
    """A rollout past its calls, tokens or seconds gets a 429 naming the budget; one call,
    token or second short of each it may still call."""
    gateway = _gateway(max_calls=4, max_generated_tokens=100, timeout_s=10.0)
    gateway._check_budget(_session(calls=3, tokens=99, age_s=9.0))
    with pytest.raises(GatewayError) as raised:
        gateway._check_budget(_session(**spent))
    assert raised.value.status == 429 and raised.value.code == code


def test_no_budget_set_means_no_limit():
    _gateway(max_calls=None, max_generated_tokens=None)._check_budget(
        _session(calls=10_000, tokens=10**9))


def test_max_tokens_is_capped_by_the_completion_length_and_what_is_left_of_the_token_budget():
    """A call that asks for no max_tokens is capped by the budget too (it used to get a whole
    max_completion_length, overshooting agent_max_tokens), and by what earlier calls left."""
    gateway = _gateway(max_generated_tokens=100)
    assert _gateway()._max_tokens(None) == 256  # max_completion_length
    assert gateway._max_tokens(None) == 100  # the rollout's token budget
    assert gateway._max_tokens(None, spent=90) == 10
    assert gateway._max_tokens(50) == 50
    assert gateway._max_tokens(50, spent=70) == 30
    assert gateway._max_tokens(500) == 100
    assert _gateway()._max_tokens(500) == 256
    roomy = _gateway(max_generated_tokens=1000)  # a budget larger than one completion
    assert roomy._max_tokens(None) == roomy._max_tokens(500) == 256
    for bad in (0, -1, True, "3", 2.5):
        with pytest.raises(GatewayError, match="max_tokens must be a positive integer"):
            gateway._max_tokens(bad)
    with pytest.raises(GatewayError, match="max_output_tokens must be a positive integer") as raised:
        gateway._max_tokens(0, param="max_output_tokens")  # the field the agent sent is named
    assert raised.value.param == "max_output_tokens"


@pytest.mark.parametrize("endpoint,body", [
    ("_complete", {"messages": [{"role": "user", "content": "hi"}]}),
    ("_respond", {"input": "hi"}),
])
def test_a_call_is_capped_by_what_the_rollouts_earlier_calls_left(endpoint, body):
    """Both endpoints pass the tokens the rollout already generated to the cap: 90 of a budget
    of 100 spent, a call that asks for nothing is sampled with max_tokens 10, not 100."""
    gateway = _gateway(max_generated_tokens=100)
    sampled = []

    async def sample(session, messages, tools, tool_choice, max_tokens, stops=()):
        sampled.append(max_tokens)
        return {"role": "assistant", "content": "ok"}, "stop", (1, 1), None

    gateway._sample = sample
    asyncio.run(getattr(gateway, endpoint)(_session(tokens=90), {"model": "tiny", **body}))
    assert sampled == [10]


@pytest.mark.parametrize("endpoint,body,param", [
    ("_complete", {"messages": [], "max_tokens": 0}, "max_tokens"),
    ("_complete", {"messages": [], "max_completion_tokens": 0}, "max_completion_tokens"),
    ("_respond", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_a_bad_token_cap_is_refused_under_the_name_the_agent_sent(endpoint, body, param):
    """The 400 names the field in the request (it said 'max_tokens' whichever was sent)."""
    with pytest.raises(GatewayError, match=f"^{param} must be a positive integer") as raised:
        asyncio.run(getattr(_gateway(), endpoint)(_session(), {"model": "tiny", **body}))
    assert raised.value.status == 400 and raised.value.param == param


def test_models_answers_only_a_rollouts_own_key():
    """Only `Bearer <key>` (RFC 6750: the scheme, a space, the key) carries the key: the key
    alone, or glued to the scheme, is no credential."""
    gateway = _gateway()
    gateway.sessions["grpo-key"] = _session()

    def status(headers):
        request = make_mocked_request("GET", "/v1/models", headers=headers)
        return asyncio.run(gateway._models(request)).status

    assert status({"Authorization": "Bearer grpo-key"}) == 200
    assert status({"Authorization": "Bearer someone-else"}) == 401
    assert status({}) == 401
    assert status({"Authorization": "grpo-key"}) == 401
    assert status({"Authorization": "Bearer:grpo-key"}) == 401
