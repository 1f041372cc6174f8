"""What the worker learns about the server at start-up, and the sampling settings it sends.

Design decision: the server is probed once (`/v1/models`, `/server_info`, `/metrics`) and the
facts decide three things the user never configures: the initial concurrency cap (KV tokens),
whether each request gets its own seed (yes for GPU servers, where data-parallel engines
sharing a seed decode identical text; never on a CPU server, where a preempted seeded request
crashes the engine), and whether sampling masks can be asked for (otherwise the importance
ratios under top-k/top-p/min-p are biased, and we warn once).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

from grpo_agent.rollout.concurrency import kv_cache_tokens
from grpo_agent.sampler.client import SamplerClient, SamplingParams
from grpo_agent.sampler.errors import SamplerError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0


@dataclass
class ServerFacts:
    model_id: str
    max_model_len: int
    kv_tokens: int | None  # None: the server has no /metrics (or no cache info on it)
    on_cpu: bool
    supports_sampling_mask: bool


def find_key(tree: Any, key: str) -> Any:
    """The first value stored under `key` anywhere in a nested JSON document, else None."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        children = tree.values()
    elif isinstance(tree, list):
        children = tree
    else:
        return None
    for child in children:
        found = find_key(child, key)
        if found is not None:
            return found
    return None


async def probe_server(client: SamplerClient) -> ServerFacts:
    """Ask the server what it is; `/server_info` and `/metrics` are optional."""
    info = await client.model_info()
    try:
        server_info = await client.server_info()
    except SamplerError as error:
        logger.info("No /server_info on %s (%s); assuming a GPU server without sampling masks.",
                    client.base_url, error)
        server_info = {}
    device = find_key(server_info, "device_config")
    return ServerFacts(
        model_id=info.id,
        max_model_len=info.max_model_len,
        kv_tokens=await _fetch_kv_tokens(client.base_url),
        on_cpu=isinstance(device, dict) and device.get("device") == "cpu",
        supports_sampling_mask=bool(find_key(server_info, "return_sampling_mask")),
    )


async def _fetch_kv_tokens(base_url: str) -> int | None:
    async with httpx.AsyncClient(base_url=base_url, timeout=PROBE_TIMEOUT_S) as http:
        try:
            response = await http.get("/metrics")
        except httpx.HTTPError:
            return None
    return kv_cache_tokens(response.text) if response.status_code == 200 else None


def truncates_vocabulary(config: Any) -> bool:
    return config.top_k > 0 or config.top_p < 1.0 or bool(config.min_p)


def build_sampling_params(config: Any, eos_token_ids: list[int], facts: ServerFacts) -> SamplingParams:
    """The per-request settings from the config (the seed is added per request)."""
    wants_mask = truncates_vocabulary(config)
    if wants_mask and not facts.supports_sampling_mask:
        logger.warning(
            "top_k/top_p/min_p are set but the vLLM server cannot return sampling masks "
            "(start it with --return-sampling-mask --enable-scale-out; impossible on CPU), so "
            "log-probs stay over the full vocabulary and importance ratios will be biased."
        )
    return SamplingParams(
        max_tokens=config.max_completion_length,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        num_logprobs=config.num_sampler_logprobs if config.score_centering else 0,
        stop_token_ids=list(eos_token_ids) or None,
        return_sampling_mask=wants_mask and facts.supports_sampling_mask,
    )
