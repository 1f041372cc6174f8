"""`gloo` weight sync: raw parameter bytes broadcast to our engine inside a CPU vLLM server
(`inside_vllm/gloo_engine.py`) over a private gloo group."""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from grpo_agent import stall
from grpo_agent.sampler.errors import (
    RequestRejectedError,
    ServerUnreachableError,
    WeightSyncError,
)
from grpo_agent.sampler.server_facts import weight_version_label
from grpo_agent.weight_sync.transports.control import (
    ServerControl,
    SyncTimings,
    finish_push,
    start_update,
)
from grpo_agent.weight_sync.wire import (
    DEFAULT_CHUNK_BYTES,
    PackedWeights,
    TensorSpec,
    broadcast_from_trainer,
    open_group,
    pack,
    plan_chunks,
    spec_of,
)

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RENDEZVOUS_THREAD = "weight-sync-rendezvous"
CLOSE_TIMEOUT_S = 10.0  # best-effort engine shutdown when the trainer closes the sync


def _release_rendezvous(opener: threading.Thread, host: str, init_info: dict[str, Any],
                        timeout: float) -> None:
    """The server refused to join: join the trainer's waiting group as its missing ranks, so
    the opener thread ends now instead of sitting in C++ until the rendezvous timeout (a
    thread blocked there when the interpreter exits aborts the process)."""
    world_size = init_info["world_size"]

    def join_as(rank: int) -> None:
        try:
            open_group(host, init_info["master_port"], rank, world_size, timeout)
        except Exception as error:  # noqa: BLE001 -- a rank the server's workers did take
            logger.debug("releasing the gloo rendezvous as rank %d: %s", rank, error)

    stand_ins = [threading.Thread(target=join_as, args=(rank,), daemon=True)
                 for rank in range(1, world_size)]
    for thread in stand_ins:
        thread.start()
    opener.join(10.0)


def _described(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor],
                                                                       list[TensorSpec]]:
    tensors = dict(weights)
    return tensors, [spec_of(name, tensor) for name, tensor in tensors.items()]


class GlooWeightSync:
    """Broadcast raw parameter bytes to the server's `gloo` engine (CPU servers)."""

    def __init__(self, control: ServerControl, *, master_address: str = "127.0.0.1",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 300.0):
        self.control = control
        self.master_address = master_address
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._group = None
        self._store = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")

    def _connect(self) -> None:
        """Open the group; the server's workers join while the init RPC is in flight."""
        world_size = 1 + self.control.worker_count()
        init_info = {"master_address": self.master_address, "master_port": _free_port(),
                     "rank_offset": 1, "world_size": world_size,
                     "chunk_bytes": self.chunk_bytes, "timeout_s": self.timeout}
        rpc = self._executor.submit(self.control.call, "POST", "/init_weight_transfer_engine",
                                    json_body={"init_info": init_info})
        opened: dict[str, Any] = {}

        def open_trainer_end() -> None:
            opened["store"], opened["group"] = open_group(
                self.master_address, init_info["master_port"], 0, world_size, self.timeout)

        # A daemon thread, so a server that refuses the init cannot leave us (or the
        # interpreter's exit) waiting out the rendezvous timeout.
        opener = threading.Thread(target=open_trainer_end, daemon=True,
                                  name=RENDEZVOUS_THREAD)
        opener.start()
        while opener.is_alive():
            if rpc.done() and rpc.exception() is not None:
                _release_rendezvous(opener, self.master_address, init_info, self.timeout)
                # The trainer's transport follows the server's --weight-transfer-config
                # (`detect_backend`), and gloo meets at 127.0.0.1: the fix is the server's.
                raise WeightSyncError(
                    f"{self.control.base_url} refused to start gloo weight transfer: "
                    f"{rpc.exception()}. Start the server on the trainer's machine with "
                    "--weight-transfer-config '{\"backend\": \"gloo\"}', or without "
                    "--weight-transfer-config to have the trainer write the weights to a "
                    "folder the server reloads (disk)."
                ) from rpc.exception()
            opener.join(0.05)
        if "group" not in opened:
            raise WeightSyncError(f"gloo rendezvous with {self.control.base_url} failed; "
                                  f"see the server log.")
        rpc.result(timeout=self.timeout)
        self._store, self._group = opened["store"], opened["group"]

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTimings:
        """Pack and send chunk by chunk (one chunk's copy in memory at a time)."""
        tensors, specs = _described(weights)
        chunks = (pack(chunk, tensors) for chunk in plan_chunks(specs, self.chunk_bytes))
        return self._send(specs, chunks, version)

    def prepare(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> PackedWeights:
        """Copy every weight into its wire chunks now, so `send` may run while the trainer
        changes the model (a background push holds one copy of the weights)."""
        tensors, specs = _described(weights)
        return PackedWeights(version, specs,
                             [pack(chunk, tensors) for chunk in plan_chunks(specs, self.chunk_bytes)])

    def send(self, packed: PackedWeights) -> SyncTimings:
        return self._send(packed.specs, packed.chunks, packed.version)

    def _send(self, specs: list[TensorSpec], chunks: Iterable[torch.Tensor],
              version: int) -> SyncTimings:
        began = time.perf_counter()
        if self._group is None:
            with stall.stage("weight_sync/transfer", phase="open transfer group"):
                self._connect()
        update_info = {"names": [s.name for s in specs],
                       "dtype_names": [s.dtype_name for s in specs],
                       "shapes": [list(s.shape) for s in specs]}
        transfer_began = time.perf_counter()
        start_update(self.control)
        with stall.stage("weight_sync/transfer", version=version, tensors=len(specs)):
            rpc = self._executor.submit(self.control.call, "POST", "/update_weights",
                                        json_body={"update_info": update_info})
            for chunk in chunks:
                if rpc.done():
                    rpc.result()  # the server refused the update: surface its message, don't hang
                broadcast_from_trainer(self._group, chunk)
            rpc.result(timeout=self.timeout)
        with stall.stage("weight_sync/finish", version=version):
            # The version rides on the finish call (vLLM sets it right after the finish).
            self.control.call("POST", "/finish_weight_update",
                              json_body={"weight_version": weight_version_label(version)})
        transfer_s = time.perf_counter() - transfer_began
        finish_push(self.control, version, version_set=True)
        return SyncTimings(pause_s=0.0, transfer_s=transfer_s,
                           total_s=time.perf_counter() - began,
                           num_bytes=sum(s.num_bytes for s in specs))

    def reopen(self) -> None:
        """Forget the group (its server died): the next push opens one with the new server."""
        self._group = self._store = None

    def close(self) -> None:
        if self._group is not None:
            try:
                # Bounded: a push cut off by a signal leaves the server's update waiting for
                # bytes, and the shutdown queues behind it; exiting must not wait that out.
                self.control.call("POST", "/shutdown_weight_transfer_engine",
                                  timeout=CLOSE_TIMEOUT_S)
            except (ServerUnreachableError, RequestRejectedError, httpx.HTTPError) as error:
                # Best effort at exit: never mask the error that ended the run.
                logger.warning("could not shut down the server's transfer engine: %s", error)
        self._group = self._store = None
        self._executor.shutdown(wait=False)
        self.control.close()
