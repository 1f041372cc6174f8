"""Push every weight of the policy (LoRA merged in) as model version N, on any server.

Design decision: a push may overlap the next training step. Where the transport can
snapshot the weights (`prepare`: gloo, the CPU servers' transport), one trainer process
copies them into the wire chunks at the step's end and sends from a background thread while
the next step pulls and trains; the next push (or `wait`) collects its outcome first, so at
most one is in flight and a failed one surfaces at the next push, which the trainer's
recovery then retries. `on_served(version)` fires once the server serves a version: only then
may the rollout worker label new groups with it. Under FSDP, for models above
`BACKGROUND_MAX_BYTES` (the snapshot doubles their memory) and with the other transports (NCCL
streams from the model, disk writes files), the push runs in the step.

The transport (gloo for a CPU server, NCCL for a GPU one, a safetensors folder as fallback) is
`transports`' business, chosen by the server's configuration at start and asked again after a
restart (`reopen`: a server restarted by hand may come back with other flags); this module
only decides *what* is pushed and *who* takes part: every rank gathers (FSDP2 all-gathers are
collectives), rank 0 sends, and all ranks meet at a barrier so none starts the next step on
old weights. A send that fails on rank 0 still takes
part in every gather and the barrier before it raises, so the ranks stay in step and can agree
on a retry (`sampler/recovery.py`).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train import fsdp
from grpo_agent.train.weights import (
    full_weights,
    has_trained_adapter,
    merged_adapters,
    served_weights_may_differ,
)
from grpo_agent.weight_sync.transports import build_weight_sync, server_backend
from grpo_agent.weight_sync.transports.control import SyncTimings

logger = logging.getLogger(__name__)

# Above this many bytes of weights a push runs in the step: a background one holds a copy.
BACKGROUND_MAX_BYTES = 1 << 30


class WeightPusher:
    """The merged-weights `Pusher`."""

    lora_name = None  # the rollout worker samples the served base model

    def __init__(self, args: AsyncGRPOConfig, backend: str | None = None, *,
                 background: bool = True) -> None:
        """`backend` is the server's weight-transfer backend (`ServerFacts`); None asks it (as
        the first push after a restart does: `reopen`). `background`: let pushes overlap the
        next step where the transport allows it."""
        self.args = args
        self.last_num_bytes = 0
        self.on_served: Callable[[int], None] = served_nowhere
        self.backend = backend
        self.background = False
        self._background_wanted = background
        self._sending: Future | None = None
        self._sender: ThreadPoolExecutor | None = None
        self._ask_backend = False  # set by `reopen`: the restarted server may take another
        self._sync: Any = None
        if fsdp.is_main_process():
            if self.backend is None:
                self.backend = server_backend(args.vllm_server_base_url, args.vllm_server_timeout)
            self._use(build_weight_sync(args.vllm_server_base_url, backend=self.backend,
                                        timeout=args.vllm_server_timeout))

    def _use(self, sync: Any) -> None:
        """Push through `sync` from now on: in the background where it can snapshot."""
        self._sync = sync
        self.background = (self._background_wanted and fsdp.world_size() == 1
                           and hasattr(sync, "prepare"))
        if self.background and self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-push")

    def needs_initial_push(self, model: nn.Module, holds_pushed_weights: bool) -> bool:
        """Unless the server serves the model's weights already: a fresh one does when the
        trainer loaded them from its checkpoint and they did not change since, and no trained
        LoRA adapter was passed in (it serves the base model then); see
        `served_weights_may_differ`."""
        return served_weights_may_differ(model, holds_pushed_weights) or has_trained_adapter(model)

    def push(self, model: nn.Module, version: int, *, merge_adapters: bool = True) -> dict[str, float]:
        """Send all weights as `version` (LoRA merged in unless `merge_adapters` is False);
        returns the perf/weight_sync_* timings: this call's, and those of a background push
        that ended since (whose failure this call raises instead)."""
        started = time.perf_counter()
        metrics = self.wait()
        failed = self._follow_server_backend()
        unwrapped = getattr(model, "module", model)
        merging = merged_adapters(unwrapped) if merge_adapters else contextlib.nullcontext()
        if failed is None and self.background and _num_bytes(unwrapped) <= BACKGROUND_MAX_BYTES:
            with torch.no_grad(), merging:
                packed = self._sync.prepare(full_weights(unwrapped), version)
            self._sending = self._sender.submit(self._send, packed)
            return {**metrics, "perf/weight_sync_s": time.perf_counter() - started,
                    "perf/weight_sync_barrier_s": 0.0}
        timings = None
        with torch.no_grad(), merging:
            weights = full_weights(unwrapped)
            try:
                if self._sync is not None and failed is None:
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
        metrics.update({
            "perf/weight_sync_s": time.perf_counter() - started,
            "perf/weight_sync_barrier_s": time.perf_counter() - barrier_started,
        })
        if timings is not None:
            metrics.update(self._sent(timings))
        self.on_served(version)
        return metrics

    def wait(self) -> dict[str, float]:
        """Until a background push has ended: its timings, or its error raised."""
        if self._sending is None:
            return {}
        sending, self._sending = self._sending, None
        return self._sent(sending.result())

    def _send(self, packed: Any) -> SyncTimings:
        timings = self._sync.send(packed)
        self.on_served(packed.version)
        return timings

    def _sent(self, timings: SyncTimings) -> dict[str, float]:
        self.last_num_bytes = timings.num_bytes
        return {"perf/weight_sync_pause_s": timings.pause_s,
                "perf/weight_sync_transfer_s": timings.transfer_s}

    def reopen(self) -> None:
        """The server was restarted: the next push opens a new transfer group with it (a
        background push into the old one is awaited and forgotten: the restore pushes again),
        after asking it which backend it takes now (`_follow_server_backend`)."""
        with contextlib.suppress(Exception):
            self.wait()
        reopen = getattr(self._sync, "reopen", None)
        if reopen is not None:
            reopen()
        self._ask_backend = self._sync is not None

    def _follow_server_backend(self) -> Exception | None:
        """After a restart, rank 0 asks the server its weight-transfer backend again and, if it
        changed, pushes through that one from now on. A server restarted by hand may come back
        with other flags (without --weight-transfer-config, or with another backend); pushing
        the old way would then fail and stop the run, while every backend pushes the same full
        weights as the same version, so switching is safe. Returns the error of asking or of
        building the new transport: the caller raises it after the other ranks' gathers."""
        if not self._ask_backend:
            return None
        url, timeout = self.args.vllm_server_base_url, self.args.vllm_server_timeout
        try:
            backend = server_backend(url, timeout)
            if backend != self.backend:
                old = self._sync
                self._use(build_weight_sync(url, backend=backend, timeout=timeout))
                logger.warning("The restarted vLLM server at %s takes weights by %s, no longer by "
                               "%s (its --weight-transfer-config changed): pushing by %s from "
                               "now on.", url, backend, self.backend, backend)
                self.backend = backend
                old.close()
        except Exception as error:  # noqa: BLE001 - raised after the other ranks' collectives
            return error
        self._ask_backend = False
        return None

    def close(self) -> None:
        """Ends a background push (the trainer settles it first where it must land); its
        failure is logged, not raised: the run is stopping, maybe for a reason of its own."""
        if self._sending is not None and not self._sending.cancel():
            try:
                self._sending.result(timeout=self.args.vllm_server_timeout)
            except Exception as error:  # noqa: BLE001
                logger.warning("The last weight push did not land (%s): the server may serve "
                               "an older version than the trained model.", error)
        self._sending = None
        if self._sender is not None:
            self._sender.shutdown(wait=False)
        close = getattr(self._sync, "close", None)
        if close is not None:
            close()


def served_nowhere(version: int) -> None:
    """A pusher's `on_served` until the trainer gives it the rollout worker's."""


def _num_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
