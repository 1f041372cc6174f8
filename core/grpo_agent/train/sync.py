"""Push the trainer's weights to the vLLM server as model version N.

The transport (gloo for a CPU server, NCCL for a GPU one, a safetensors folder as fallback) is
the sampler's business and is picked from what the server reports; this module only decides
*what* is pushed and *who* takes part: every rank gathers (FSDP2 all-gathers are collectives),
rank 0 sends, and all ranks meet at a barrier so none starts the next step on old weights.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train import fsdp
from grpo_agent.train.weights import full_weights, merged_adapters


class WeightPusher:
    def __init__(self, args: AsyncGRPOConfig) -> None:
        self.args = args
        self._sync: Any = None
        if fsdp.is_main_process():
            from grpo_agent.sampler.weight_sync import build_weight_sync

            self._sync = build_weight_sync(args.vllm_server_base_url)

    def push(self, model: nn.Module, version: int) -> dict[str, float]:
        """Send all weights as `version`; returns the perf/weight_sync_* timings."""
        started = time.perf_counter()
        unwrapped = getattr(model, "module", model)
        timings = None
        with torch.no_grad(), merged_adapters(unwrapped):
            weights = full_weights(unwrapped)
            if self._sync is not None:
                timings = self._sync.push(weights, version)
            else:
                for _ in weights:  # other ranks take part in the gathers only
                    pass
        barrier_started = time.perf_counter()
        if fsdp.world_size() > 1:
            torch.distributed.barrier()
        metrics = {
            "perf/weight_sync_s": time.perf_counter() - started,
            "perf/weight_sync_barrier_s": time.perf_counter() - barrier_started,
        }
        if timings is not None:
            metrics["perf/weight_sync_pause_s"] = timings.pause_s
            metrics["perf/weight_sync_transfer_s"] = timings.transfer_s
        return metrics

    def close(self) -> None:
        close = getattr(self._sync, "close", None)
        if close is not None:
            close()
