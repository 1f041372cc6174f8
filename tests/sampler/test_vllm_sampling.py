"""The sampler client against the real vLLM server of the session (tiny model, float32)."""
import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_agent.sampler import RequestRejectedError, SamplerClient, SamplingParams
from grpo_agent.weight_sync.transports.control import ServerControl

from .hf_reference import max_gap, token_logprobs

pytestmark = pytest.mark.vllm

PROMPT = list(range(10, 60))


def run(coroutine_fn, base_url, **client_kwargs):
    async def main():
        async with SamplerClient(base_url, timeout=300, **client_kwargs) as client:
            return await coroutine_fn(client)
    return asyncio.run(main())


@pytest.fixture(scope="module")
def hf_model(vllm_server):
    return AutoModelForCausalLM.from_pretrained(vllm_server.model_path, dtype=torch.float32)


def test_model_info_reports_the_served_max_model_len(vllm_server):
    info = run(lambda c: c.model_info(), vllm_server.base_url)
    assert info.max_model_len == 1024 and info.id


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_server_logprobs_match_a_transformers_forward_in_float32(vllm_server, hf_model, endpoint):
    params = SamplingParams(max_tokens=24, num_logprobs=5, ignore_eos=True)
    turn = run(lambda c: c.generate(PROMPT, params), vllm_server.base_url, endpoint=endpoint)
    assert len(turn.output_ids) == 24 and turn.finish_reason == "length"
    reference = token_logprobs(hf_model, PROMPT, turn.output_ids)
    assert max_gap(turn.output_log_probs, reference) < 1e-3
    for position, top in enumerate(turn.output_sampler_logprobs):
        assert len(top) == 5
        assert max(top.values()) >= turn.output_log_probs[position] - 1e-6
    if endpoint == "generate":
        assert turn.weight_versions is not None and len(turn.weight_versions) == 24


def test_top_k_logprobs_are_the_models_true_top_k(vllm_server, hf_model):
    params = SamplingParams(max_tokens=8, num_logprobs=4)
    turn = run(lambda c: c.generate(PROMPT, params), vllm_server.base_url)
    ids = torch.tensor([PROMPT + turn.output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(ids).logits[0], dim=-1)
    for position, top in enumerate(turn.output_sampler_logprobs):
        expected = logprobs[len(PROMPT) - 1 + position].topk(4)
        assert set(top) == set(expected.indices.tolist())


def test_stop_token_ends_generation_with_reason_stop(vllm_server):
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = run(lambda c: c.generate(PROMPT, greedy), vllm_server.base_url)
    stop_at = first.output_ids[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[stop_at])
    turn = run(lambda c: c.generate(PROMPT, params), vllm_server.base_url)
    assert turn.finish_reason == "stop" and turn.output_ids[-1] == stop_at


def test_32_concurrent_generations_complete_while_metrics_are_read(vllm_server):
    # Whether a snapshot lands while the engine reports requests in flight is a race with the
    # box's scheduler (CI once took 3 snapshots of a 192-token round, all before the engine
    # started or after it finished), so each round that sees no load is followed by a longer
    # one. Gauges that never move (a wrong metric name, a parser reading 0) fail all three:
    # a snapshot with requests running must also show the KV cache they hold (the parser reads
    # a missing kv_cache_usage_perc as 0, so a renamed gauge passed the range check alone).
    async def one_round(client, tokens):
        params = SamplingParams(max_tokens=tokens, num_logprobs=8, ignore_eos=True)
        tasks = [asyncio.create_task(client.generate(PROMPT[: 20 + i], params))
                 for i in range(32)]
        snapshots = []
        while not all(task.done() for task in tasks):
            snapshots.append(await client.metrics())
            await asyncio.sleep(0.02)
        return await asyncio.gather(*tasks), snapshots

    async def main(client):
        rounds = []
        for tokens in (192, 480, 900):
            turns, snapshots = await one_round(client, tokens)
            rounds.append((tokens, turns, snapshots))
            if max(s.running for s in snapshots) > 0:
                break
        return rounds

    rounds = run(main, vllm_server.base_url)
    for tokens, turns, snapshots in rounds:
        assert len(turns) == 32
        for turn in turns:
            assert len(turn.output_ids) == tokens == len(turn.output_log_probs)
            assert all(len(top) == 8 for top in turn.output_sampler_logprobs)
        assert snapshots and all(0.0 <= s.kv_cache_usage <= 1.0 for s in snapshots)
        assert all(0 <= s.running <= 32 and s.waiting >= 0 and s.preemptions >= 0
                   for s in snapshots)
    seen = [(tokens, len(snapshots)) for tokens, _, snapshots in rounds]
    busy = [s for _, _, snapshots in rounds for s in snapshots if s.running > 0]
    assert busy, f"no /metrics snapshot saw a request running (tokens, snapshots): {seen}"
    assert all(s.kv_cache_usage > 0 for s in busy), f"requests ran on an empty KV cache: {busy}"


def test_prompt_longer_than_max_model_len_fails_at_once_with_the_servers_message(vllm_server):
    async def main(client):
        with pytest.raises(RequestRejectedError, match="maximum model length") as error:
            await client.generate([5] * 1100, SamplingParams(max_tokens=4))
        return error.value.status_code, client.retry_count

    status, retries = run(main, vllm_server.base_url)
    assert status == 400 and retries == 0


def test_a_request_sent_while_paused_completes_after_resume(vllm_server):
    control = ServerControl(vllm_server.base_url, timeout=120)

    async def main(client):
        control.call_retried("POST", "/pause?mode=keep&clear_cache=false", retries=0)
        try:
            task = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_tokens=4)))
            await asyncio.sleep(1.0)
            assert not task.done()
        finally:
            control.call_retried("POST", "/resume", retries=0)
        return await asyncio.wait_for(task, timeout=120)

    with control:
        assert len(run(main, vllm_server.base_url).output_ids) == 4


def test_prefix_cache_reset_succeeds_when_idle(vllm_server):
    with ServerControl(vllm_server.base_url, timeout=120) as control:
        assert control.call("POST", "/reset_prefix_cache")["success"] is True
