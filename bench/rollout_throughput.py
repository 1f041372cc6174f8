"""Generated tokens/s through the rollout worker vs the raw sampler client, same server.

Runs with no arguments: builds the tiny model, starts its own vLLM server (or uses
`--base-url`), then measures at the same concurrency:
  1. the raw `SamplerClient` with top-8 log-probs (the worker's default request),
  2. the full rollout worker (spawned process, scoring, queue) with a consumer that keeps up,
  3. the raw client again without log-probs.
Prints one JSON object per phase, then a summary line with `ratio` (worker / raw, target
>= 0.95) and `logprobs_overhead` (1 - tokens/s with top-8 / tokens/s without).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

CONCURRENCY = 8
GROUP_SIZE = 4
MAX_TOKENS = 32


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 3 == 0) for ids in completion_ids]


async def _raw_tokens_per_s(base_url: str, prompt_ids: list[int], num_logprobs: int, seconds: float) -> float:
    from grpo_agent.sampler.client import SamplerClient, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, num_logprobs=num_logprobs)
    async with SamplerClient(base_url) as client:
        await client.generate(prompt_ids, params)  # warm-up
        tokens = 0
        started = time.perf_counter()

        async def lane():
            nonlocal tokens
            while time.perf_counter() - started < seconds:
                turn = await client.generate(prompt_ids, params)
                tokens += len(turn.output_ids)  # not `tokens += len(await ...)`: lost updates

        await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
        return tokens / (time.perf_counter() - started)


def _worker_tokens_per_s(base_url: str, model_path: str, seconds: float) -> float:
    from datasets import Dataset
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.rollout.worker import RolloutWorker
    from transformers import AutoTokenizer

    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(), num_generations=GROUP_SIZE, max_completion_length=MAX_TOKENS,
        max_concurrent_rollouts=CONCURRENCY, max_staleness=1000, vllm_server_base_url=base_url,
        report_to="none")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "count to ten"}]}] * 64)
    worker = RolloutWorker(AsyncRolloutLoop, config=config, model_name=model_path, dataset=dataset,
                           reward_funcs=[token_sum_reward],
                           processing_class=AutoTokenizer.from_pretrained(model_path))
    with worker:
        worker.report_step_tokens(10**9)  # no staleness backpressure: measure generation
        while not worker.pull(timeout=1.0):  # warm-up: the first group runs alone
            pass
        _consume(worker, seconds=2.0)
        worker.drain_metrics()
        _consume(worker, seconds=seconds)
        amount = elapsed = 0.0
        for name, value in worker.drain_metrics():
            if name == "rollout/generated_tokens_per_s":
                amount, elapsed = amount + value[0], elapsed + value[1]
    if elapsed == 0:
        raise RuntimeError("the worker reported no generation progress; is the server alive?")
    return amount / elapsed


def _consume(worker, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        worker.pull(timeout=0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="use this server instead of starting one")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    from contextlib import nullcontext

    from grpo_agent.sampler.server import ManagedVLLMServer
    from grpo_agent.testing import build_tiny_model
    from transformers import AutoTokenizer

    model_path = str(build_tiny_model())
    server = nullcontext() if args.base_url else ManagedVLLMServer(model_path, max_model_len=512)
    with server as started:
        base_url = args.base_url or started.base_url
        if args.base_url:
            import httpx
            model_path = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "count to ten"}],
                                             add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        raw = asyncio.run(_raw_tokens_per_s(base_url, prompt_ids, 8, args.seconds))
        print(json.dumps({"phase": "raw_top8", "tokens_per_s": round(raw, 1)}), flush=True)
        worker = _worker_tokens_per_s(base_url, model_path, args.seconds)
        print(json.dumps({"phase": "worker_top8", "tokens_per_s": round(worker, 1)}), flush=True)
        raw_off = asyncio.run(_raw_tokens_per_s(base_url, prompt_ids, 0, args.seconds))
        print(json.dumps({"phase": "raw_no_logprobs", "tokens_per_s": round(raw_off, 1)}), flush=True)
    print(json.dumps({
        "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS,
        "ratio": round(worker / raw, 3), "logprobs_overhead": round(1 - raw / raw_off, 3),
        "worker_tokens_per_s": round(worker, 1), "raw_tokens_per_s": round(raw, 1),
    }))


if __name__ == "__main__":
    main()
