"""Generated tokens/s through the agent gateway (the `openai` client) vs the raw sampler client.

Both sides sample the same conversations at the same concurrency on the same server, with the
same fixed-length outputs (`ignore_eos`). The raw side sends pre-rendered prompt ids through
`HarnessRolloutLoop.generate_one_turn` (the `SamplerClient` request every rollout makes); the
gateway side sends the messages with `openai.AsyncOpenAI` to `/v1/chat/completions`, so it also
pays for HTTP to the gateway, rendering with the chat template, decoding and tool-call parsing
and the OpenAI response. Rounds alternate so drift on a shared machine hits both equally. One
JSON line per round; the last line is the summary, whose `ratio` (gateway / raw, target >= 0.9)
is the median of the per-round ratios.

`--client in-loop` (default) runs the `openai` client on the gateway's event loop, as an async
agent does in the rollout worker: the client's own cost (building and parsing its pydantic
models, about as much as the gateway's) shares that loop. `--client process` runs it in a
separate process, as a command agent or an external harness does; the process times itself
after a warm-up, so its start is not counted. `--client httpx` posts the same JSON with a plain
`httpx.AsyncClient` on the loop and reads the JSON back (no client models): what the gateway
itself costs, apart from the `openai` client's own work.

    python bench/gateway_overhead.py [--base-url URL] [--concurrency 16] [--rounds 4] [--client process|httpx]

Without --base-url it builds the tiny model and starts its own vLLM server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

CLIENT_PROCESS = """
import asyncio, json, sys, time
import openai

async def main(url, key, model, concurrency, items):
    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(messages):
        async with gate:
            await client.chat.completions.create(model=model, messages=messages)

    await asyncio.gather(*(one(m) for m in items[:concurrency]))  # warm-up, not timed
    began = time.perf_counter()
    await asyncio.gather(*(one(m) for m in items))
    print(time.perf_counter() - began)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.load(sys.stdin)))
"""


async def in_process(url: str, key: str, model: str, concurrency: int, items) -> float:
    """One round from a separate client process; the seconds it timed."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT_PROCESS, url, key, model, str(concurrency),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate(json.dumps(items).encode())
    if process.returncode != 0:
        raise SystemExit(f"the client process failed with {process.returncode}")
    return float(out.decode().split()[-1])


def conversations(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Question {i}: " + "count the words here " * (2 + i % 8)}]
            for i in range(count)]


async def run_all(send, items, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(item):
        async with gate:
            await send(item)

    began = time.perf_counter()
    await asyncio.gather(*(one(item) for item in items))
    return time.perf_counter() - began


async def bench(base_url: str, model_path: str, args) -> dict:
    import httpx
    import openai
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.agent import ConversationRenderer
    from grpo_agent.rollout.gateway import Gateway, HarnessLimits
    from grpo_agent.rollout.harness import HarnessRolloutLoop
    from grpo_agent.sampler.client import SamplerClient
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = AsyncGRPOConfig(output_dir=tempfile.mkdtemp(), vllm_server_base_url=base_url,
                             max_completion_length=args.tokens, report_to="none",
                             max_concurrent_rollouts=args.concurrency)
    loop = HarnessRolloutLoop(
        config=config, model_name=None, dataset=None, reward_funcs=None, processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        agent=None, limits=HarnessLimits(max_calls=None))  # no agent: the bench is the client
    await loop.connect(SamplerClient(base_url, max_connections=args.concurrency + 8),
                       ThreadPoolExecutor(args.concurrency))
    loop.sampling_params = replace(loop.sampling_params, ignore_eos=True)  # fixed lengths
    loop.model_name = loop.server.model_id
    gateway = loop.gateway = Gateway(loop, loop.limits)
    await gateway.start()
    session = gateway.open_session(0)
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
    items = conversations(args.requests)
    renderer = ConversationRenderer(tokenizer, None, {}, rerenders=True)  # as the gateway renders
    rendered = {id(m): renderer.prompt_ids(m) for m in items}
    results = {"raw": [], "gateway": []}

    async def raw(messages):
        await loop.generate_one_turn(rendered[id(messages)])

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency),
                             headers={"Authorization": f"Bearer {session.key}"})

    async def through_gateway(messages):
        if args.client == "httpx":
            response = await http.post(gateway.base_url + "/chat/completions",
                                       json={"model": loop.model_name, "messages": messages})
            response.raise_for_status()
            response.json()
        else:
            await client.chat.completions.create(model=loop.model_name, messages=messages)

    try:
        await run_all(through_gateway, items[: args.concurrency], args.concurrency)  # warm-up
        for index in range(args.rounds):
            order = [("raw", raw), ("gateway", through_gateway)]
            for name, send in order if index % 2 == 0 else order[::-1]:
                if name == "gateway" and args.client == "process":
                    seconds = await in_process(gateway.base_url, session.key, loop.model_name,
                                               args.concurrency, items)
                else:
                    seconds = await run_all(send, items, args.concurrency)
                rate = args.requests * args.tokens / seconds
                results[name].append(rate)
                print(json.dumps({"round": index, "client": name, "tokens_per_s": round(rate, 1),
                                  "seconds": round(seconds, 3)}), flush=True)
    finally:
        await client.close()
        await http.aclose()
        await gateway.stop()
        await loop.sampler.aclose()
        loop.tool_executor.shutdown(wait=False)
    warmups = 1 + (args.rounds if args.client == "process" else 0)  # each process warms up
    expected = args.concurrency * warmups + args.requests * args.rounds  # every call recorded
    assert len(session.turns) == expected, (len(session.turns), expected)  # each one recorded
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="an already running vLLM server (read-only use)")
    parser.add_argument("--model-path", help="the server's model folder (for its tokenizer)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--client", choices=("in-loop", "process", "httpx"), default="in-loop",
                        help="where the openai client runs (see the module docstring)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        base_url, model_path = args.base_url, args.model_path
        if base_url is None:
            from grpo_agent.sampler.server import ManagedVLLMServer
            from grpo_agent.testing import build_tiny_model

            model_path = str(build_tiny_model())
            server = stack.enter_context(ManagedVLLMServer(model_path, dtype="float32",
                                                           enforce_eager=True))
            base_url = server.base_url
        results = asyncio.run(bench(base_url, model_path, args))
    raw, ours = statistics.median(results["raw"]), statistics.median(results["gateway"])
    paired = statistics.median(g / r for g, r in zip(results["gateway"], results["raw"]))
    print(json.dumps({"summary": "gateway_overhead", "client": args.client,
                      "concurrency": args.concurrency,
                      "requests_per_round": args.requests, "tokens_per_request": args.tokens,
                      "raw_tokens_per_s": round(raw, 1), "gateway_tokens_per_s": round(ours, 1),
                      "ratio": round(paired, 4), "ratio_of_medians": round(ours / raw, 4),
                      "target_ratio": 0.9}))


if __name__ == "__main__":
    main()
