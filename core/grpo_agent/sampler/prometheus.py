"""A minimal parser for the Prometheus text format that vLLM serves on `/metrics`.

We only need a handful of gauges and counters (KV-cache usage, running/waiting requests,
preemptions), summed or maxed over engines, and the KV-cache size from one info metric's
labels, so a line parser beats a client dependency.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"


@dataclass
class ServerMetrics:
    """The scheduler state the rollout loop's concurrency control reacts to."""

    # Fraction in [0, 1], the fullest engine; None: the server reports no
    # `vllm:kv_cache_usage_perc` (a renamed gauge, another server), i.e. unknown, never 0.
    kv_cache_usage: float | None
    running: int
    waiting: int
    preemptions: int  # cumulative since the server started


def parse_samples(text: str) -> dict[str, list[float]]:
    """Map each metric name (labels dropped) to the values of all its label sets."""
    samples: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name = line.split("{", 1)[0]
            value = line.rsplit("}", 1)[1].split()[0]
        else:
            name, value = line.split()[:2]
        try:
            samples.setdefault(name, []).append(float(value))
        except ValueError:
            continue
    return samples


def parse_server_metrics(text: str) -> ServerMetrics | None:
    """Extract `ServerMetrics`, or None when the text holds no vLLM scheduler metrics."""
    samples = parse_samples(text)
    if "vllm:num_requests_running" not in samples:
        return None
    usage = samples.get(KV_CACHE_USAGE)
    return ServerMetrics(
        kv_cache_usage=max(usage) if usage else None,
        running=int(sum(samples["vllm:num_requests_running"])),
        waiting=int(sum(samples.get("vllm:num_requests_waiting", [0.0]))),
        preemptions=int(sum(samples.get("vllm:num_preemptions_total", [0.0]))),
    )


_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_cache_tokens(metrics_text: str) -> int | None:
    """Total KV-cache tokens over engines from `vllm:cache_config_info`, None if absent.

    vLLM 0.32 labels it with `kv_cache_size_tokens`; older servers only give
    `num_gpu_blocks` x `block_size`.
    """
    total = 0
    for match in _CACHE_INFO.finditer(metrics_text):
        labels = dict(_LABEL.findall(match.group("labels")))
        size = labels.get("kv_cache_size_tokens", "None")
        if size.isdigit():
            total += int(size)
        elif labels.get("num_gpu_blocks", "None").isdigit() and labels.get("block_size", "").isdigit():
            total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return total or None
