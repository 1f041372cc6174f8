"""A vLLM server's CPU per engine step and per generated token, by requests in flight and top-k.

Issue 21's pipeline found vLLM's engine costing more per generated token for us than for TRL.
This bench isolates the server: for each concurrency (requests of n=8 in flight) and each
`num_logprobs`, it sends `/inference/v1/generate` requests (64 tokens each, ignore_eos) and
reads the engine's steps and tokens from `/metrics` and the CPU of the API server, the engine
core and its worker from `/proc`. One JSON line per case. `--top-k K` asks for K+1 log-probs
per token as the client does (8: the spec's score centering, `logprobs: 9`); `--logprob-form`
asks for vLLM's own answer (`vllm`, an object per candidate) and/or our plugin's columns
(`columns`, header `x-grpo-agent-logprobs: columns`), alternating within each round.

    python -m grpo_agent.sampler.vllm_entry serve ... &   # or a ManagedVLLMServer
    PYTHONPATH=core python bench/server_cost.py --base-url URL --server-pid PID \
        --concurrency 4,8,16 --top-k 0,8 --logprob-form vllm,columns --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import httpx
from grpo_agent.sampler import SamplingParams
from grpo_agent.sampler.client import generate_body
from grpo_agent.sampler.vllm_answer import ANSWER_HEADER, COLUMNS, LOGPROBS_HEADER

COUNTERS = ("vllm:generation_tokens_total", "vllm:iteration_tokens_total_count")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(c) for c in read(f"/proc/{pid}/task/{task}/children").split()]
        except OSError:
            pass
    return found


def cpu_seconds(pid: int) -> float:
    fields = read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters(base_url: str) -> dict[str, float]:
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(COUNTERS):
            name = line.split("{")[0].split(" ")[0]
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


async def case(base_url: str, api_pid: int, engine: dict[int, str], model: str,
               concurrency: int, top_k: int, form: str) -> dict:
    params = SamplingParams(max_tokens=64, num_logprobs=top_k, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    headers = {LOGPROBS_HEADER: COLUMNS} if form == COLUMNS else {}
    answered, sizes = set(), []
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> None:
            body = generate_body(model, list(range(10 + i % 7, 30)), params, n=8)
            async with gate:
                response = await client.post(base_url + "/inference/v1/generate", json=body,
                                             headers=headers)
                response.raise_for_status()
                answered.add(response.headers.get(ANSWER_HEADER, "vllm"))
                sizes.append(len(response.content))

        before, cpu0, api0 = counters(base_url), {p: cpu_seconds(p) for p in engine}, cpu_seconds(api_pid)
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(max(8, 3 * concurrency))))
        wall = time.perf_counter() - start
        after, cpu1, api1 = counters(base_url), {p: cpu_seconds(p) for p in engine}, cpu_seconds(api_pid)
    steps = after[COUNTERS[1]] - before[COUNTERS[1]]
    tokens = after[COUNTERS[0]] - before[COUNTERS[0]]
    engine_cpu = sum(cpu1[p] - cpu0[p] for p in engine)
    return {"concurrency": concurrency, "sequences": 8 * concurrency, "top_k": top_k,
            "form": form, "answered": sorted(answered), "body_kb": round(sum(sizes) / len(sizes) / 1e3, 1),
            "tokens_per_step": round(tokens / steps, 1),
            "engine_ms_per_step": round(engine_cpu / steps * 1e3, 2),
            "engine_us_per_token": round(engine_cpu / tokens * 1e6, 1),
            "api_us_per_token": round((api1 - api0) / tokens * 1e6, 1),
            "tokens_per_s": round(tokens / wall),
            "ms_per_step_by_process": {engine[p]: round((cpu1[p] - cpu0[p]) / steps * 1e3, 2)
                                       for p in engine}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--server-pid", type=int, required=True, help="the API server process")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--top-k", default="0,8", help="num_logprobs values (8: the spec's top-8, "
                        "logprobs 9 asked)")
    parser.add_argument("--logprob-form", default="vllm", help="vllm, columns or both (vllm,columns)")
    parser.add_argument("--rounds", type=int, default=1)
    opts = parser.parse_args()
    engine_pids = children(opts.server_pid)
    engine_pids += [c for p in list(engine_pids) for c in children(p)]
    engine = {p: read(f"/proc/{p}/comm").strip() for p in engine_pids}
    model = httpx.get(opts.base_url + "/v1/models").json()["data"][0]["id"]
    for _ in range(opts.rounds):
        for concurrency in (int(c) for c in opts.concurrency.split(",")):
            for top_k in (int(k) for k in opts.top_k.split(",")):
                for form in opts.logprob_form.split(","):
                    if form not in ("vllm", COLUMNS):
                        raise SystemExit(f"--logprob-form {form!r}: give vllm and/or columns")
                    print(json.dumps(asyncio.run(case(opts.base_url, opts.server_pid, engine, model,
                                                      concurrency, top_k, form))), flush=True)


if __name__ == "__main__":
    main()
