"""Push every weight of the policy (LoRA merged in) as model version N, on any server.

The transport (gloo for a CPU server, NCCL for a GPU one, a safetensors folder as fallback) is
`transports`' business; this module only decides *what* is pushed and *who* takes part: every
rank gathers (FSDP2 all-gathers are collectives), rank 0 sends, and all ranks meet at a
barrier so none starts the next step on old weights. A send that fails on rank 0 still takes
part in every gather and the barrier before it raises, so the ranks stay in step and can agree
on a retry (`sampler/recovery.py`).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train import fsdp
from grpo_agent.train.weights import full_weights, merged_adapters
from grpo_agent.weight_sync.transports import build_weight_sync


class WeightPusher:
    """The merged-weights `Pusher`."""

    lora_name = None  # the rollout worker samples the served base model

    def __init__(self, args: AsyncGRPOConfig, backend: str | None = None) -> None:
        """`backend` is the server's weight-transfer backend (`ServerFacts`); None asks it."""
        self.args = args
        self.last_num_bytes = 0
        self._sync: Any = None
        if fsdp.is_main_process():
            self._sync = build_weight_sync(args.vllm_server_base_url, backend=backend,
                                           timeout=args.vllm_server_timeout)

    def needs_initial_push(self, model: nn.Module, holds_pushed_weights: bool) -> bool:
        """A fresh server already serves the model's weights; one an earlier run pushed into
        may not."""
        return holds_pushed_weights

    def push(self, model: nn.Module, version: int, *, merge_adapters: bool = True) -> dict[str, float]:
        """Send all weights as `version` (LoRA merged in unless `merge_adapters` is False);
        returns the perf/weight_sync_* timings."""
        started = time.perf_counter()
        unwrapped = getattr(model, "module", model)
        timings = None
        merging = merged_adapters(unwrapped) if merge_adapters else contextlib.nullcontext()
        failed = None
        with torch.no_grad(), merging:
            weights = full_weights(unwrapped)
            try:
                if self._sync is not None:
                    timings = self._sync.push(weights, version)
            except Exception as error:  # noqa: BLE001 - raised after the other ranks' collectives
                failed = error
            for _ in weights:  # the other ranks take part in the gathers only; a send cut short
                pass           # must still take part in the gathers the others wait in
        barrier_started = time.perf_counter()
        if fsdp.world_size() > 1:
            torch.distributed.barrier()  # also after a failed send: the others wait here
        if failed is not None:
            raise failed
        metrics = {
            "perf/weight_sync_s": time.perf_counter() - started,
            "perf/weight_sync_barrier_s": time.perf_counter() - barrier_started,
        }
        if timings is not None:
            metrics["perf/weight_sync_pause_s"] = timings.pause_s
            metrics["perf/weight_sync_transfer_s"] = timings.transfer_s
            self.last_num_bytes = timings.num_bytes
        return metrics

    def reopen(self) -> None:
        """The server was restarted: the next push opens a new transfer group with it."""
        reopen = getattr(self._sync, "reopen", None)
        if reopen is not None:
            reopen()

    def close(self) -> None:
        close = getattr(self._sync, "close", None)
        if close is not None:
            close()
