"""A group's first turns from one request with `n`, against the session's real vLLM server.

Each record of an `n`-request must mean what a per-rollout request's record means: its own
completion ids, the server's log-probs and top-k of exactly those ids, its finish reason and
the weight version it was sampled with. The engine's group path must send one request for the
group's first turns and one per later turn, whatever number of turns each rollout takes.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout import first_turns
from grpo_agent.rollout.engine import RolloutEngine
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.prompts import PromptSlot
from grpo_agent.rollout.versions import VersionValue
from grpo_agent.sampler import SamplerClient, SamplingParams
from grpo_agent.types import Rollout
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.vllm

PROMPT = list(range(10, 60))
GROUP = 4
TOOL_RESULT = [11, 12, 13]  # stands in for a rendered tool result between turns


@pytest.fixture(scope="module")
def hf_model(rollout_server):
    return AutoModelForCausalLM.from_pretrained(rollout_server[1], dtype=torch.float32)


def reference_logprobs(model, prompt_ids, output_ids):
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return logprobs[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output_ids)]


def assert_record_is_the_servers_view_of_its_own_ids(turn, prompt_ids, model, k, max_tokens,
                                                      versions=True):
    """Ids, log-probs, top-k, finish reason and versions all describe this record's sample
    (`/v1/completions` reports no weight versions)."""
    n = len(turn.output_ids)
    assert turn.prompt_ids == list(prompt_ids) and 1 <= n <= max_tokens
    assert turn.finish_reason in ("stop", "length")
    assert turn.finish_reason == "stop" or n == max_tokens
    assert len(turn.output_log_probs) == n and len(turn.output_sampler_logprobs) == n
    if versions:
        assert turn.weight_versions is not None and len(turn.weight_versions) == n
    reference = reference_logprobs(model, prompt_ids, turn.output_ids)
    for position, token in enumerate(turn.output_ids):
        assert abs(turn.output_log_probs[position] - reference[position, token].item()) < 1e-3
        top = turn.output_sampler_logprobs[position]
        assert len(top) == k
        assert set(top) == set(reference[position].topk(k).indices.tolist())


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_each_choice_of_an_n_request_is_a_full_record_of_its_own_sample(
        rollout_server, hf_model, endpoint):
    params = SamplingParams(max_tokens=12, num_logprobs=4)

    async def main():
        async with SamplerClient(rollout_server[0], timeout=300, endpoint=endpoint) as client:
            return await client.generate_many(PROMPT, params, GROUP)

    turns = asyncio.run(main())
    assert len(turns) == GROUP
    for turn in turns:
        assert_record_is_the_servers_view_of_its_own_ids(turn, PROMPT, hf_model, 4, 12,
                                                          versions=endpoint == "generate")
    assert len({tuple(turn.output_ids) for turn in turns}) == GROUP  # n samples, not one n times
    assert len({id(turn.prompt_ids) for turn in turns}) == GROUP  # no shared mutable lists


def test_greedy_n_samples_go_out_as_n_requests_vllm_accepts(rollout_server):
    """vLLM answers n > 1 at temperature 0 with HTTP 400 ("n must be 1 when using greedy
    sampling"), so a greedy group (training at temperature 0) would lose every first turn."""
    params = SamplingParams(max_tokens=6, temperature=0.0, num_logprobs=2)
    bodies = []

    async def main():
        async with SamplerClient(rollout_server[0], timeout=300) as client:
            send = client._request

            async def recording(method, path, **kwargs):
                if path.endswith("/generate"):
                    bodies.append(kwargs["json"]["sampling_params"])
                return await send(method, path, **kwargs)

            client._request = recording
            return await client.generate_many(PROMPT, params, 3)

    turns = asyncio.run(main())
    assert [body.get("n", 1) for body in bodies] == [1, 1, 1]
    assert all(body["temperature"] == 0.0 for body in bodies)
    assert len(turns) == 3 and all(1 <= len(turn.output_ids) <= 6 for turn in turns)
    assert all(len(turn.output_sampler_logprobs) == len(turn.output_ids) for turn in turns)


# ---------------------------------------------------------------- the engine's group path

class TurnsLoop(AsyncRolloutLoop):
    """Rollout k of a group (in the order they ask) takes k % 3 + 1 turns; each later turn's
    prompt is the last prompt, its output and a fixed 'tool result' (a tool loop's shape)."""

    async def generate_one(self, prompt, tools, group_id=0):
        self.asked = getattr(self, "asked", 0) + 1
        turns_wanted = (self.asked - 1) % 3 + 1
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self.tool_executor, lambda: self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
        turns = []
        for _ in range(turns_wanted):
            turn = await self.generate_one_turn(list(prompt_ids))
            turns.append(turn)
            prompt_ids = turn.prompt_ids + turn.output_ids + TOOL_RESULT
        return Rollout(completion=[{"role": "assistant", "content": "x"}],
                       completion_ids=[t for turn in turns for t in turn.output_ids], turns=turns)


def one_group(rollout_server, tokenizer, tmp_path, *, share, loop_cls=AsyncRolloutLoop, slots=8):
    """Run one group through the engine's group path; return it and the requests sent."""
    base_url, model_path = rollout_server
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), num_generations=GROUP, max_completion_length=8,
        max_concurrent_rollouts=slots, vllm_server_base_url=base_url, report_to="none", seed=0,
        share_first_turn_request=share, num_sampler_logprobs=4)
    row = {"prompt": [{"role": "user", "content": "Count from 1 to 5."}]}
    channels = SimpleNamespace(model_version=VersionValue(0), server_down=None)
    loop = loop_cls(config, model_path, Dataset.from_list([row]), [lambda completion_ids, **_: [0.0]],
                    tokenizer, [tokenizer.eos_token_id], channels=channels)
    requests = []

    async def main():
        async with SamplerClient(base_url, timeout=300) as sampler:
            many = sampler.generate_many  # every request goes through it (generate: n=1)

            async def generate_many(prompt_ids, params, n, *, model=None):
                requests.append((list(prompt_ids), n))
                return await many(prompt_ids, params, n, model=model)

            sampler.generate_many = generate_many
            executor = ThreadPoolExecutor(4)
            try:
                engine = RolloutEngine(loop, channels)
                await loop.connect(sampler, executor)
                engine._start_scheduling()
                await engine._run_group(PromptSlot(0, 0, 0, row), group_id=0)
                return engine.score_queue.get_nowait()
            finally:
                executor.shutdown(wait=True)

    return asyncio.run(main()), requests


@pytest.fixture
def no_timer(monkeypatch):
    """The fallback timer out of the way, so a loaded box cannot split the group's request."""
    monkeypatch.setattr(first_turns, "WAIT_S", 3600.0)


@pytest.mark.parametrize("share", [True, False])
def test_the_groups_first_turns_are_one_request_with_the_same_records(
        rollout_server, rollout_tokenizer, hf_model, tmp_path, no_timer, share):
    group, requests = one_group(rollout_server, rollout_tokenizer, tmp_path, share=share)
    first_prompt = group.rollouts[0].turns[0].prompt_ids
    expected = [(first_prompt, GROUP)] if share else [(first_prompt, 1)] * GROUP
    assert requests == expected
    for rollout in group.rollouts:
        (turn,) = rollout.turns
        assert_record_is_the_servers_view_of_its_own_ids(turn, first_prompt, hf_model, 4, 8)
    assert len({tuple(r.completion_ids) for r in group.rollouts}) == GROUP
    # one weight version for every token of the group (the server's, no push in between)
    assert len({v for r in group.rollouts for v in r.turns[0].weight_versions}) == 1
    assert group.model_version == 0 and len(group.completions_sequences) == GROUP


def test_rollouts_taking_different_numbers_of_turns_share_only_the_first(
        rollout_server, rollout_tokenizer, hf_model, tmp_path, no_timer):
    group, requests = one_group(rollout_server, rollout_tokenizer, tmp_path, share=True,
                                loop_cls=TurnsLoop)
    first_prompt = group.rollouts[0].turns[0].prompt_ids
    assert requests[0] == (first_prompt, GROUP)
    assert sorted(len(r.turns) for r in group.rollouts) == [1, 1, 2, 3]
    later = [turn for r in group.rollouts for turn in r.turns[1:]]
    assert sorted(n for _, n in requests[1:]) == [1] * len(later) == [1, 1, 1]
    for rollout in group.rollouts:
        for turn in rollout.turns:
            assert_record_is_the_servers_view_of_its_own_ids(turn, turn.prompt_ids, hf_model, 4, 8)
        for previous, turn in zip(rollout.turns, rollout.turns[1:]):  # each continues its own
            assert turn.prompt_ids == previous.prompt_ids + previous.output_ids + TOOL_RESULT
        assert rollout.completion_ids == [t for turn in rollout.turns for t in turn.output_ids]
    assert [len(seqs) for seqs in group.completions_sequences] == [1] * GROUP  # no forks


@pytest.mark.timeout(300)  # a group that waited for rollouts that wait for its slots would hang
def test_with_fewer_slots_than_rollouts_the_group_still_finishes(
        rollout_server, rollout_tokenizer, tmp_path, no_timer):
    """Two slots for four rollouts: those waiting for a slot are not waited for."""
    group, requests = one_group(rollout_server, rollout_tokenizer, tmp_path, share=True, slots=2)
    assert len(group.rollouts) == GROUP
    assert sum(n for _, n in requests) == GROUP and len(requests) >= 2


# ---------------------------------------------------------------- evaluation rows

EVAL_ROWS = [{"prompt": [{"role": "user", "content": f"Count from 1 to {k}."}]} for k in (3, 5, 7)]


def evaluate_rows(rollout_server, tokenizer, tmp_path, *, share, temperature, k, slots):
    """Evaluate EVAL_ROWS k times each; return the result and the (prompt ids, n) requests."""
    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings

    base_url, model_path = rollout_server
    config = AsyncGRPOConfig(output_dir=str(tmp_path), max_completion_length=8, report_to="none",
                             vllm_server_base_url=base_url, share_first_turn_request=share)
    settings = EvalSettings(temperature=temperature, num_generations=k, max_concurrent=slots)
    requests = []

    async def main():
        session = EvalSession(AsyncRolloutLoop, config=config, processing_class=tokenizer,
                              reward_funcs=[lambda completion_ids, **_: [1.0] * len(completion_ids)],
                              settings=settings, model_name=model_path)
        async with session:
            many = session.loop.sampler.generate_many  # every request goes through it

            async def generate_many(prompt_ids, params, n, *, model=None):
                requests.append((list(prompt_ids), n))
                return await many(prompt_ids, params, n, model=model)

            session.loop.sampler.generate_many = generate_many
            return await session.evaluate(EVAL_ROWS, version=0)

    return asyncio.run(main()), requests


@pytest.mark.parametrize(("share", "temperature", "k", "slots", "per_row"), [
    (True, 1.0, 4, 8, [4]),  # pass@4: one request with n=4 per row
    (True, 1.0, 4, 4, [4]),  # the row's rollouts take all the slots together
    (False, 1.0, 4, 8, [1, 1, 1, 1]),  # sharing off
    (True, 1.0, 4, 3, [1, 1, 1, 1]),  # k above the slots: the rollouts cannot start together
    (True, 0.0, 2, 8, [1, 1]),  # greedy: vLLM refuses n > 1
])
def test_eval_rows_share_their_first_turns_request_when_sampled(
        rollout_server, rollout_tokenizer, hf_model, tmp_path, no_timer, share, temperature, k,
        slots, per_row):
    result, requests = evaluate_rows(rollout_server, rollout_tokenizer, tmp_path, share=share,
                                     temperature=temperature, k=k, slots=slots)
    by_prompt: dict[tuple, list[int]] = {}
    for prompt_ids, n in requests:
        by_prompt.setdefault(tuple(prompt_ids), []).append(n)
    assert sorted(by_prompt.values()) == [per_row] * len(EVAL_ROWS)
    assert [len(row.passed) for row in result.rows] == [k] * len(EVAL_ROWS)
    assert result.metrics["eval/pass@1"] == 1.0 and len(result.served_versions) == 1
    if temperature > 0:  # k samples of the row, not one sample k times
        assert all(len(set(row.completions)) == k for row in result.rows)
