"""Is one request per group (`n` samples of one prompt) cheaper than `n` requests? Same server,
same prompts and sampling, alternating rounds.

Each round samples `--groups` groups of `--n` fixed-length completions (top-8 log-probs, as the
rollout worker asks) with at most `--concurrency` samples in flight, either as `n` separate
`/inference/v1/generate` requests per group (what the rollout loop sends today) or as one
request with `n` (vLLM shares the prompt). Per round: generated tokens/s, this process's
CPU per 1,000 tokens (JSON decode included) and response bytes per token. The last line is the
summary (medians; `*_ratio` = grouped / separate).

    python bench/group_requests.py --base-url URL [--rounds 6] [--groups 16] [--n 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from grpo_agent.sampler import SamplingParams
from grpo_agent.sampler.client import _sampling_body


async def round_of(http, model, body, groups, n, concurrency, grouped) -> dict:
    gate = asyncio.Semaphore(max(1, concurrency // n) if grouped else concurrency)
    received = {"bytes": 0, "tokens": 0}

    async def post(prompt, count):
        async with gate:
            response = await http.post("/inference/v1/generate", json={
                "model": model, "token_ids": prompt,
                "sampling_params": {**body, "n": count}})
            response.raise_for_status()
            data = response.json()
        received["bytes"] += len(response.content)
        received["tokens"] += sum(len(c["token_ids"]) for c in data["choices"])
        if len(data["choices"]) != count:
            raise SystemExit(f"asked n={count}, got {len(data['choices'])} choices")

    jobs = []
    for g in range(groups):
        prompt = [(7 * g + j) % 1500 + 10 for j in range(24 + g % 8)]
        jobs += [post(prompt, n)] if grouped else [post(prompt, 1) for _ in range(n)]
    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*jobs)
    seconds, cpu_s = time.perf_counter() - began, time.process_time() - cpu
    return {"tokens_per_s": received["tokens"] / seconds,
            "cpu_ms_per_1k_tokens": 1e6 * cpu_s / received["tokens"],
            "bytes_per_token": received["bytes"] / received["tokens"]}


async def main_async(opts) -> None:
    body = _sampling_body(SamplingParams(max_tokens=opts.tokens, ignore_eos=True))
    async with httpx.AsyncClient(base_url=opts.base_url, timeout=600.0,
                                 limits=httpx.Limits(max_connections=512)) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await round_of(http, model, body, 4, opts.n, opts.concurrency, True)  # warm-up
        rows = {"separate": [], "grouped": []}
        for index in range(opts.rounds):
            order = ["separate", "grouped"] if index % 2 == 0 else ["grouped", "separate"]
            for name in order:
                row = await round_of(http, model, body, opts.groups, opts.n, opts.concurrency,
                                     name == "grouped")
                rows[name].append(row)
                print(json.dumps({"round": index, "mode": name,
                                  **{k: round(v, 2) for k, v in row.items()}}), flush=True)
    summary = {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
               for name, rs in rows.items()}
    for key in summary["grouped"]:
        summary[f"{key}_ratio"] = round(summary["grouped"][key] / summary["separate"][key], 3)
    print(json.dumps({"summary": "group_requests", "n": opts.n, "groups": opts.groups,
                      "tokens": opts.tokens, **summary}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
