"""`AsyncRolloutLoop`'s own rules without a server: reward names must differ, a row needs a
prompt (or an env that builds one), a seeded server's seeds advance by n per request, and a
rollout whose adapter was unloaded mid-rollout finishes on the newest one (nothing else is
retried)."""
from __future__ import annotations

import asyncio
import itertools

import pytest
from grpo_agent.rollout.loop import AsyncRolloutLoop, _named_reward_funcs, _row_prompt
from grpo_agent.rollout.versions import VersionValue
from grpo_agent.sampler.client import SamplingParams
from grpo_agent.sampler.errors import RequestRejectedError


def test_two_reward_functions_of_one_name_are_refused():
    def score(completions, **kwargs):
        return [0.0] * len(completions)

    def other(completions, **kwargs):
        return [0.0] * len(completions)

    other.__name__ = "score"
    with pytest.raises(ValueError, match="Two reward functions are both named 'score'"):
        _named_reward_funcs([score, other])


def test_a_row_without_a_prompt_names_its_columns_and_the_fix():
    with pytest.raises(KeyError, match=r"no 'prompt' column \(it has: \['answer', 'question'\]\)"):
        _row_prompt({"question": "2+2?", "answer": "4"})


class ScriptedSampler:
    def __init__(self, reject=None):
        self.requests = []
        self.reject = reject  # the model name whose requests are rejected with `reject`'s error

    async def generate(self, prompt_ids, params, model=None):
        self.requests.append((model, params.seed, 1))
        if self.reject is not None and model == self.reject[0]:
            raise self.reject[1]
        return "turn"

    async def generate_many(self, prompt_ids, params, n, model=None):
        self.requests.append((model, params.seed, n))
        return ["turn"] * n


def bare_loop(sampler, seeds=None, lora_name=None, version=0):
    loop = AsyncRolloutLoop.__new__(AsyncRolloutLoop)
    loop.sampler, loop.seeds, loop.lora_name = sampler, seeds, lora_name
    loop.model_version_value = VersionValue(version)
    return loop


def test_a_seeded_server_gets_a_fresh_seed_per_request_skipping_n():
    sampler = ScriptedSampler()
    loop = bare_loop(sampler, seeds=itertools.count(100))
    params = SamplingParams(max_tokens=4)
    asyncio.run(loop._sample_turns([1], params, None, 3))  # seeds 100, 101, 102
    asyncio.run(loop._sample_turns([1], params, None, 1))
    assert [(seed, n) for _, seed, n in sampler.requests] == [(100, 3), (103, 1)]


@pytest.mark.parametrize(("status", "retried"), [(404, True), (400, False)])
def test_an_unloaded_adapter_finishes_on_the_newest_and_other_rejections_raise(status, retried):
    error = RequestRejectedError("rejected", status_code=status, server_message="no such model")
    sampler = ScriptedSampler(reject=("run-v2", error))
    loop = bare_loop(sampler, lora_name="run", version=5)
    params = SamplingParams(max_tokens=4)
    if retried:
        assert asyncio.run(loop._sample_turns([1], params, "run-v2", 1)) == ["turn"]
        assert [model for model, _, _ in sampler.requests] == ["run-v2", "run-v5"]
    else:
        with pytest.raises(RequestRejectedError):
            asyncio.run(loop._sample_turns([1], params, "run-v2", 1))
    # On the newest adapter already, a 404 is not retried.
    newest = ScriptedSampler(reject=("run-v5", RequestRejectedError("x", status_code=404)))
    with pytest.raises(RequestRejectedError):
        asyncio.run(bare_loop(newest, lora_name="run", version=5)._sample_turns([1], params, "run-v5", 1))
    assert len(newest.requests) == 1
