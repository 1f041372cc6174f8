"""Throughput through `SamplerClient` vs a plain concurrent HTTP baseline, same server.

Both sides send identical `/inference/v1/generate` requests (fixed-length outputs, top-8
logprobs, the client's `x-grpo-agent-logprobs` header when it asks for columns) at the same
concurrency; the baseline only posts and decodes the JSON, ours also
builds `TurnRecord`s (top-k selection, weight-version expansion, retry bookkeeping). Rounds
alternate between the two so drift on a shared machine hits both equally. Prints one JSON
object per round; the last line is the summary, whose `ratio` (ours / baseline, target
>= 0.97) is the median of the per-round ratios. On a shared box throughput swings with other
jobs' load, so each round also reports this process's CPU per 1,000 tokens (the client's own
cost, which load barely moves): `client_cpu_ratio` is ours / baseline of its medians.

    python bench/sampler_overhead.py [--base-url URL] [--concurrency 32] [--rounds 6]

Without --base-url it builds the tiny model and starts its own vLLM server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time

import httpx
from grpo_agent.sampler import SamplerClient, SamplingParams
from grpo_agent.sampler.client import generate_body
from grpo_agent.sampler.vllm_answer import COLUMNS, LOGPROBS_HEADER


def prompts(count: int) -> list[list[int]]:
    return [[(7 * i + j) % 1500 + 10 for j in range(32 + i % 16)] for i in range(count)]


async def run_requests(send, prompt_list, concurrency: int) -> float:
    """Send all prompts with at most `concurrency` in flight; returns wall seconds."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with gate:
            await send(prompt)

    began, cpu_began = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(p) for p in prompt_list))
    return time.perf_counter() - began, time.process_time() - cpu_began


async def bench(base_url: str, concurrency: int, rounds: int, requests: int, tokens: int):
    params = SamplingParams(max_tokens=tokens, num_logprobs=8, ignore_eos=True)
    prompt_list = prompts(requests)
    async with SamplerClient(base_url) as client, \
            httpx.AsyncClient(base_url=base_url, timeout=600.0,
                              limits=httpx.Limits(max_connections=512)) as plain:
        model = (await client.model_info()).id
        headers = {LOGPROBS_HEADER: COLUMNS} if client.logprob_columns else {}

        async def send_plain(prompt):
            response = await plain.post("/inference/v1/generate",
                                        json=generate_body(model, prompt, params), headers=headers)
            response.raise_for_status()
            response.json()

        async def send_ours(prompt):
            await client.generate(prompt, params)

        await run_requests(send_ours, prompt_list[:concurrency], concurrency)  # warm-up
        results = {"baseline": [], "ours": []}
        cpu_ms = {"baseline": [], "ours": []}  # this process's CPU per 1,000 tokens
        for round_index in range(rounds):
            order = [("baseline", send_plain), ("ours", send_ours)]
            for name, send in order if round_index % 2 == 0 else order[::-1]:
                seconds, cpu_s = await run_requests(send, prompt_list, concurrency)
                tokens_per_s = requests * tokens / seconds
                results[name].append(tokens_per_s)
                cpu_ms[name].append(1e6 * cpu_s / (requests * tokens))
                print(json.dumps({"round": round_index, "client": name,
                                  "tokens_per_s": round(tokens_per_s, 1),
                                  "seconds": round(seconds, 3),
                                  "client_cpu_ms_per_1k_tokens": round(cpu_ms[name][-1], 2)}),
                      flush=True)
        return results, cpu_ms, client.retry_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="an already running vLLM server (read-only use)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            from grpo_agent.sampler.server import ManagedVLLMServer
            from grpo_agent.testing import build_tiny_model

            server = stack.enter_context(ManagedVLLMServer(build_tiny_model(), dtype="float32",
                                                           enforce_eager=True))
            base_url = server.base_url
        results, cpu_ms, retries = asyncio.run(bench(base_url, args.concurrency, args.rounds,
                                             args.requests, args.tokens))
    baseline = statistics.median(results["baseline"])
    ours = statistics.median(results["ours"])
    # Rounds run back to back in pairs, so the per-pair ratio cancels most machine drift.
    paired = statistics.median(o / b for o, b in zip(results["ours"], results["baseline"]))
    print(json.dumps({"summary": "sampler_overhead", "concurrency": args.concurrency,
                      "requests_per_round": args.requests, "tokens_per_request": args.tokens,
                      "baseline_tokens_per_s": round(baseline, 1),
                      "ours_tokens_per_s": round(ours, 1), "ratio": round(paired, 4),
                      "ratio_of_medians": round(ours / baseline, 4),
                      "client_cpu_ms_per_1k_tokens": {
                          name: round(statistics.median(v), 2) for name, v in cpu_ms.items()},
                      "client_cpu_ratio": round(statistics.median(cpu_ms["ours"])
                                                / statistics.median(cpu_ms["baseline"]), 3),
                      "client_retries": retries, "target_ratio": 0.97}))


if __name__ == "__main__":
    main()
