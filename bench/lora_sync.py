"""LoRA adapter sync vs merged-weight sync on one vLLM server: bytes and time per sync, and the
generation cost of serving an adapter.

The same PEFT model (LoRA r=8 on every linear layer of the tiny model) is pushed `--syncs` times
each way, alternating, into one server started with `--enable-lora` and the gloo weight-transfer
engine: merged (`WeightPusher`: merge, send every weight, unmerge) and adapter
(`AdapterPusher`: write the adapter to `.vllm_lora/`, load it, unload the oldest). Then it
times identical fixed-length generation on the base model and on the loaded adapter (the spec
reports adapters decode ~1.33-1.39x slower on GPUs). The merged pushes change the served base
weights, so the adapter's outputs are meaningless here: only times and bytes count. One JSON object per measurement; the last
line is the summary with `bytes_ratio` and `sync_s_ratio` (adapter / merged) and
`generation_slowdown` (adapter / base seconds, median of the per-round ratios).

    python bench/lora_sync.py [--syncs 6] [--requests 32] [--tokens 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import torch


def build_model(model_path: str, rank: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))


def perturb(model) -> None:
    """Stand-in for an optimizer step: every adapter weight changes before each sync."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 1e-2)


def time_syncs(model, server_url: str, work_dir: str, syncs: int) -> list[dict]:
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.weight_sync.adapter import AdapterPusher
    from grpo_agent.weight_sync.full import WeightPusher

    args = AsyncGRPOConfig(output_dir=work_dir, vllm_server_base_url=server_url, max_staleness=1,
                           report_to="none", use_cpu=True)
    merged, adapter = WeightPusher(args), AdapterPusher(args, model, base_is_stale=False)
    rows = []
    try:
        for version in range(1, syncs + 1):
            for mode, pusher in (("merged", merged), ("adapter", adapter)):
                perturb(model)
                metrics = pusher.push(model, version)
                rows.append({"mode": mode, "version": version, "bytes": pusher.last_num_bytes,
                             "sync_s": metrics["perf/weight_sync_s"]})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        merged.close()
    return rows, adapter


async def time_generation(server_url: str, model_name: str, requests: int, tokens: int) -> float:
    from grpo_agent.sampler.client import SamplerClient, SamplingParams

    params = SamplingParams(max_tokens=tokens, num_logprobs=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 1500 + 10 for j in range(24)] for i in range(requests)]
    async with SamplerClient(server_url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client.generate(p, params, model=model_name) for p in prompts))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()

    from grpo_agent.sampler.server import ManagedVLLMServer
    from grpo_agent.testing import build_tiny_model

    model_path = build_tiny_model()
    with ManagedVLLMServer(model_path, dtype="float32", enable_lora=True, max_lora_rank=8,
                           max_loras=3, enforce_eager=True) as server, \
            tempfile.TemporaryDirectory() as work_dir:
        model = build_model(str(model_path), options.rank)
        rows, adapter = time_syncs(model, server.base_url, work_dir, options.syncs)
        served = adapter._registered[-1][0]  # the newest adapter version, still loaded
        generation = {"base": [], "adapter": []}
        for name in (str(model_path), served):  # warm-up, not timed
            asyncio.run(time_generation(server.base_url, name, 4, 8))
        pairs = [("base", str(model_path)), ("adapter", served)]
        for round_index in range(options.rounds):  # alternate, so drift hits both equally
            for mode, name in pairs if round_index % 2 == 0 else pairs[::-1]:
                seconds = asyncio.run(time_generation(server.base_url, name, options.requests,
                                                      options.tokens))
                generation[mode].append(seconds)
                print(json.dumps({"generation": mode, "seconds": seconds}), flush=True)
        adapter.close()

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    print(json.dumps({
        "summary": "lora_sync", "rank": options.rank,
        "merged_bytes": median("merged", "bytes"), "adapter_bytes": median("adapter", "bytes"),
        "bytes_ratio": median("adapter", "bytes") / median("merged", "bytes"),
        "merged_sync_s": median("merged", "sync_s"), "adapter_sync_s": median("adapter", "sync_s"),
        "sync_s_ratio": median("adapter", "sync_s") / median("merged", "sync_s"),
        # the median of per-round ratios: each round's pair ran back to back
        "generation_slowdown": statistics.median(
            a / b for a, b in zip(generation["adapter"], generation["base"])),
    }))


if __name__ == "__main__":
    main()
