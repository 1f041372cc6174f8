"""The tiled LM head's forward+backward on CPU, one thread: today's tile functions and CPU tile
budget against the previous ones (kept here as the baseline: a full [tokens x tile] product and
`where` pass, GPU-sized tiles), alternating in one process, median of 7.

    python bench/lm_head_cpu.py

Shapes: the tiny Qwen3 of bench/pipeline.py (hidden 128, vocabulary 2,048) at 900-3,000
trained tokens per row. Prints one line per row size; the last line is JSON.
"""
from __future__ import annotations

import json
import statistics
import time

import torch
from grpo_agent.train import logprobs

HIDDEN, VOCAB = 128, 2048


def previous_tile_stats(raw, temperature, allowed):
    z = logprobs._scaled_logits(raw, temperature, allowed)
    tile_max = z.amax(dim=1)
    safe_max = torch.where(torch.isfinite(tile_max), tile_max, torch.zeros_like(tile_max))
    e = torch.exp(z - safe_max[:, None])
    z_where_kept = torch.where(e > 0, z, torch.zeros_like(z))
    return tile_max, e.sum(dim=1), (e * z_where_kept).sum(dim=1)


def previous_tile_grad(raw, temperature, allowed, lse, scale):
    z = logprobs._scaled_logits(raw, temperature, allowed)
    return (torch.exp(z - lse[:, None]) * scale[:, None]).to(raw.dtype)


VARIANTS = {
    "previous": (previous_tile_stats, previous_tile_grad, "cuda"),  # the GPU tile budget
    "now": (logprobs._tile_stats, logprobs._tile_grad, "cpu"),
}


def time_variant(name: str, hidden, weight) -> float:
    stats, grad, budget_of = VARIANTS[name]
    logprobs.tile_stats.fn, logprobs.tile_grad.fn = stats, grad
    tile = logprobs.default_tile_width(hidden.shape[0], budget_of)
    began = time.perf_counter()
    lse, _ = logprobs.tiled_log_sum_exp(hidden, weight, 1.0, None, tile)
    lse.sum().backward()
    elapsed = time.perf_counter() - began
    hidden.grad = weight.grad = None
    return elapsed


def main() -> None:
    torch.set_num_threads(1)
    ratios = {}
    for tokens in (900, 1750, 3000):
        torch.manual_seed(0)
        hidden = torch.randn(tokens, HIDDEN, requires_grad=True)
        weight = (torch.randn(VOCAB, HIDDEN) * 0.05).requires_grad_()
        times = {name: [] for name in VARIANTS}
        for _ in range(7):
            for name in VARIANTS:
                times[name].append(time_variant(name, hidden, weight))
        previous, now = (statistics.median(times[name]) for name in ("previous", "now"))
        ratios[tokens] = round(now / previous, 3)
        print(f"tokens {tokens}: previous {previous * 1000:.1f} ms, now {now * 1000:.1f} ms, "
              f"now/previous {now / previous:.2f}", flush=True)
    logprobs.tile_stats.fn, logprobs.tile_grad.fn = logprobs._tile_stats, logprobs._tile_grad
    print(json.dumps({"summary": "lm_head_cpu", "now_over_previous": ratios}))


if __name__ == "__main__":
    main()
