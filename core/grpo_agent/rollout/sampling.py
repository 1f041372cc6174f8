"""The sampling settings the worker sends, and what the server's facts decide for it.

Design decision: the server's facts (`sampler.server_facts`, probed at start-up and again after
each server restore: `AsyncRolloutLoop.reconnect`) decide
three things the user never configures: the initial concurrency cap (KV tokens),
whether each request gets its own seed (yes for GPU servers, where data-parallel engines
sharing a seed decode identical text; never on a CPU server, where a preempted seeded request
crashes the engine), and whether sampling masks can be asked for (otherwise the importance
ratios under top-k/top-p/min-p are biased, and we warn once).
"""
from __future__ import annotations

import logging
from typing import Any

from grpo_agent.sampler.client import SamplingParams
from grpo_agent.sampler.server_facts import ServerFacts

logger = logging.getLogger(__name__)


def truncates_vocabulary(config: Any) -> bool:
    return config.top_k > 0 or config.top_p < 1.0 or bool(config.min_p)


def build_sampling_params(config: Any, eos_token_ids: list[int], facts: ServerFacts, *,
                          trains: bool = True) -> SamplingParams:
    """The per-request settings from the config (the seed is added per request). `trains=False`
    (an evaluation): no top log-probs, no masks and no warning about them, since nothing is
    trained on these tokens."""
    wants_mask = trains and truncates_vocabulary(config)
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
        num_logprobs=config.num_sampler_logprobs if trains and config.score_centering else 0,
        stop_token_ids=list(eos_token_ids) or None,
        return_sampling_mask=wants_mask and facts.supports_sampling_mask,
    )
