"""Weight pushes into the session's real vLLM server (gloo and disk backends).

Each test perturbs a transformers copy of the tiny model, pushes it, and checks that the
server now scores tokens like the new weights (float32, within 1e-3) and no longer like the
old ones. The original weights are pushed back at the end so later tests see the model they
expect.
"""
import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_agent.sampler import SamplerClient, SamplingParams
from grpo_agent.weight_sync.transports import build_weight_sync

from .hf_reference import max_gap, token_logprobs

pytestmark = pytest.mark.vllm

PROMPT = list(range(100, 160))


@pytest.fixture(scope="module")
def pushable_server(vllm_server):
    if not getattr(vllm_server, "owned", False):
        pytest.skip("never push weights to a server this session did not start")
    return vllm_server


@pytest.fixture
def models(pushable_server):
    """(original, perturbed) transformers models; the server is restored afterwards."""
    original = AutoModelForCausalLM.from_pretrained(pushable_server.model_path,
                                                    dtype=torch.float32)
    perturbed = AutoModelForCausalLM.from_pretrained(pushable_server.model_path,
                                                     dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    yield original, perturbed
    restore = build_weight_sync(pushable_server.base_url, backend="disk")
    try:
        restore.push(original.named_parameters(), version=0)
    finally:
        restore.close()


def sample(base_url, prompt, num_tokens=32):
    async def main():
        async with SamplerClient(base_url, timeout=300) as client:
            params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
            return await client.generate(prompt, params)
    return asyncio.run(main())


def test_backend_is_detected_from_the_servers_config(pushable_server):
    sync = build_weight_sync(pushable_server.base_url)
    try:
        assert type(sync).__name__ == "GlooWeightSync"
    finally:
        sync.close()


@pytest.mark.parametrize("backend", ["gloo", "disk"])
def test_pushed_weights_are_what_the_server_samples_with(pushable_server, models, backend):
    original, perturbed = models
    base_url = pushable_server.base_url
    # Warm the prefix cache with the prompt under the old weights: the push must drop it.
    before = sample(base_url, PROMPT)
    assert max_gap(before.output_log_probs,
                   token_logprobs(original, PROMPT, before.output_ids)) < 1e-3

    sync = build_weight_sync(base_url, backend=backend)
    try:
        timings = sync.push(perturbed.named_parameters(), version=7)
    finally:
        sync.close()
    assert timings.num_bytes == sum(p.numel() * 4 for p in perturbed.parameters())
    assert 0 < timings.transfer_s <= timings.total_s

    after = sample(base_url, PROMPT)
    assert max_gap(after.output_log_probs,
                   token_logprobs(perturbed, PROMPT, after.output_ids)) < 1e-3
    assert max_gap(after.output_log_probs,
                   token_logprobs(original, PROMPT, after.output_ids)) > 0.1
    assert after.weight_versions == ["7"] * len(after.output_ids)


def test_gloo_push_while_requests_run_keeps_the_server_alive(pushable_server, models):
    """A push that lands while requests decode: every request completes, and those running
    then switch weight versions mid-way. Up to three rounds: on a loaded box a round's push can
    land only after its requests finished (the full suite once saw all eight end on version
    0), which says nothing about the feature; with versions never switching, all rounds fail."""
    original, perturbed = models
    base_url = pushable_server.base_url
    sync = build_weight_sync(base_url, backend="gloo")
    num_requests, num_tokens = 8, 900  # prompts of 10-17 tokens: within max_model_len 1024

    async def round_(version):
        # Reset to the original weights first (this also opens the transfer group: connecting
        # can take longer than a short generation, and the point is a push mid-decode).
        await asyncio.to_thread(sync.push, original.named_parameters(), 0)
        async with SamplerClient(base_url, timeout=300) as client:
            params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
            tasks = [asyncio.create_task(client.generate(PROMPT[: 10 + i], params))
                     for i in range(num_requests)]
            # Push once the server is decoding (a failed request surfaces at the gather).
            while not any(task.done() for task in tasks):
                metrics = await client.metrics()
                if metrics is not None and metrics.running > 0:
                    break
                await asyncio.sleep(0.02)
            timings = await asyncio.to_thread(sync.push, perturbed.named_parameters(), version)
            return timings, await asyncio.gather(*tasks)

    seen = []
    try:
        for version in ("11", "12", "13"):
            timings, turns = asyncio.run(round_(int(version)))
            assert timings.total_s > 0
            assert all(len(turn.output_ids) == num_tokens for turn in turns)
            switched = [t for t in turns
                        if t.weight_versions[0] != version and t.weight_versions[-1] == version]
            seen.append([sorted(set(t.weight_versions)) for t in turns])
            if switched:
                break
    finally:
        sync.close()
    assert switched, seen
    after = sample(base_url, PROMPT)
    assert max_gap(after.output_log_probs,
                   token_logprobs(perturbed, PROMPT, after.output_ids)) < 1e-3


def test_a_weight_update_left_open_by_a_killed_trainer_does_not_block_the_next_push(
    pushable_server, models
):
    _, perturbed = models
    base_url = pushable_server.base_url
    sync = build_weight_sync(base_url, backend="gloo")
    try:
        sync.push(perturbed.named_parameters(), version=2)
        sync.control.call("POST", "/start_weight_update")  # what a trainer killed mid-push leaves
        sync.push(perturbed.named_parameters(), version=3)
    finally:
        sync.close()
    after = sample(base_url, PROMPT)
    assert max_gap(after.output_log_probs,
                   token_logprobs(perturbed, PROMPT, after.output_ids)) < 1e-3
    assert after.weight_versions == ["3"] * len(after.output_ids)


def test_a_background_push_serves_the_weights_of_the_moment_it_was_called(
        pushable_server, models, tmp_path):
    """The trainer's pusher returns before the send and trains on (`weight_sync.full`): the
    server must end up with the snapshot taken at the call, not the weights changed after it,
    and the rollout worker hears of the version only once the server serves it."""
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.weight_sync.full import WeightPusher

    original, perturbed = models
    base_url = pushable_server.base_url
    args = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=base_url,
                           use_cpu=True, report_to="none")
    pusher = WeightPusher(args, backend="gloo")
    served = []
    pusher.on_served = served.append
    try:
        assert pusher.background
        metrics = pusher.push(perturbed, 23)
        assert "perf/weight_sync_transfer_s" not in metrics  # the send runs in the background
        with torch.no_grad():  # the next optimizer step, while the push may still be sending
            for parameter in perturbed.parameters():
                parameter.add_(0.5)
        landed = pusher.wait()
        assert landed["perf/weight_sync_transfer_s"] > 0 and served == [23]
        after = sample(base_url, PROMPT)
        with torch.no_grad():
            for parameter in perturbed.parameters():
                parameter.sub_(0.5)
        assert max_gap(after.output_log_probs,
                       token_logprobs(perturbed, PROMPT, after.output_ids)) < 1e-3
        assert after.weight_versions == ["23"] * len(after.output_ids)
    finally:
        pusher.close()
