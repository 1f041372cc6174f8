"""Push trainer weights into a running vLLM server: one call, "these weights are version N".

Design decision: the trainer knows one narrow interface (`WeightSync.push`) and never which
transport runs underneath. `build_weight_sync` reads the server's own configuration
(`GET /server_info?config_format=json`) and picks:

- `gloo`: our CPU weight-transfer engine (`gloo_engine.py`), bytes over a private gloo group;
- `nccl`: vLLM's NCCL engine for GPU servers (see `nccl_sync.py`);
- `disk`: safetensors written to a folder, then `reload_weights` over `/collective_rpc`, for
  servers started without a weight-transfer config.

Every push ends by setting the server's weight version and dropping the prefix cache, since
cached KV from the old weights would otherwise keep producing old-weight logprobs.
"""
from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

from grpo_agent import stall
from grpo_agent.sampler.errors import (
    RequestRejectedError,
    ServerUnreachableError,
    WeightSyncError,
)
from grpo_agent.sampler.gloo_transport import (
    DEFAULT_CHUNK_BYTES,
    broadcast_from_trainer,
    open_group,
    pack,
    plan_chunks,
    spec_of,
)

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl", "disk")


@dataclass
class SyncTimings:
    """Where a push spent its time; `num_bytes` is what crossed the wire (or hit the disk).

    `pause_s` is how long generation was paused for the push: 0 for our backends, which load
    atomically while requests keep running. `total_s` includes the version update and the
    prefix-cache reset.
    """

    pause_s: float
    transfer_s: float
    total_s: float
    num_bytes: int


class WeightSync(Protocol):
    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTimings: ...

    def close(self) -> None: ...


class ServerControl:
    """Blocking HTTP calls to the server's weight and cache routes, each with a timeout."""

    def __init__(self, base_url: str, timeout: float):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def call(self, method: str, path: str, *, json_body: Any = None,
             params: dict | None = None, timeout: float | None = None) -> Any:
        """`timeout` overrides the client's for this call."""
        extra = {} if timeout is None else {"timeout": timeout}
        try:
            response = self._http.request(method, path, json=json_body, params=params, **extra)
        except httpx.ConnectError as error:
            raise ServerUnreachableError(
                f"No vLLM server answered at {self.base_url} ({error}); is it running?"
            ) from error
        if response.status_code >= 400:
            raise RequestRejectedError(
                f"{method} {self.base_url}{path} failed with HTTP {response.status_code}: "
                f"{response.text.strip()[:2000]}",
                status_code=response.status_code,
            )
        return response.json() if response.content else None

    def server_info(self) -> dict:
        return self.call("GET", "/server_info", params={"config_format": "json"})

    def set_version(self, version: int) -> None:
        self.call("POST", "/update_weight_version", json_body={"new_version": str(version)})

    def reset_prefix_cache(self) -> None:
        """Drop stale KV; if running requests hold blocks, preempt them so they recompute."""
        if self.call("POST", "/reset_prefix_cache").get("success"):
            return
        result = self.call("POST", "/reset_prefix_cache",
                           params={"reset_running_requests": "true"})
        if not result.get("success"):
            raise WeightSyncError(
                f"{self.base_url} refused to reset its prefix cache after a weight push; "
                f"cached KV from the old weights may still be served."
            )

    def worker_count(self) -> int:
        return int(self.call("GET", "/get_world_size", params={"include_dp": "true"})
                   ["world_size"])

    def close(self) -> None:
        self._http.close()


def _start_update(control: ServerControl) -> None:
    """Open a weight update; one left open by a trainer killed mid-push is closed first (the
    push that follows rewrites every weight, so its half-written state does not matter)."""
    try:
        with stall.stage("weight_sync/pause", server=control.base_url):
            control.call("POST", "/start_weight_update")
    except RequestRejectedError as error:
        if "already active" not in str(error):
            raise
        logger.warning("%s had a weight update left open (an earlier trainer stopped "
                       "mid-push); closing it before this push.", control.base_url)
        for path in ("/finish_weight_update", "/start_weight_update"):
            try:
                control.call("POST", path)
            except httpx.TransportError:  # the server drops a connection after a 500: retry once
                control.call("POST", path)


def _finish_push(control: ServerControl, version: int) -> None:
    with stall.stage("weight_sync/resume", server=control.base_url, version=version):
        control.set_version(version)
    with stall.stage("weight_sync/cache_reset", server=control.base_url, version=version):
        control.reset_prefix_cache()


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
                raise WeightSyncError(
                    f"{self.control.base_url} refused to start gloo weight transfer: "
                    f"{rpc.exception()}. Start the server with --weight-transfer-config "
                    f"'{{\"backend\": \"gloo\"}}' or use backend='disk'."
                ) from rpc.exception()
            opener.join(0.05)
        if "group" not in opened:
            raise WeightSyncError(f"gloo rendezvous with {self.control.base_url} failed; "
                                  f"see the server log.")
        rpc.result(timeout=self.timeout)
        self._store, self._group = opened["store"], opened["group"]

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTimings:
        began = time.perf_counter()
        if self._group is None:
            with stall.stage("weight_sync/transfer", phase="open transfer group"):
                self._connect()
        tensors = dict(weights)
        specs = [spec_of(name, tensor) for name, tensor in tensors.items()]
        update_info = {"names": [s.name for s in specs],
                       "dtype_names": [s.dtype_name for s in specs],
                       "shapes": [list(s.shape) for s in specs]}
        transfer_began = time.perf_counter()
        _start_update(self.control)
        with stall.stage("weight_sync/transfer", version=version, tensors=len(specs)):
            rpc = self._executor.submit(self.control.call, "POST", "/update_weights",
                                        json_body={"update_info": update_info})
            for chunk in plan_chunks(specs, self.chunk_bytes):
                if rpc.done():
                    rpc.result()  # the server refused the update: surface its message, don't hang
                broadcast_from_trainer(self._group, pack(chunk, tensors))
            rpc.result(timeout=self.timeout)
        with stall.stage("weight_sync/finish", version=version):
            self.control.call("POST", "/finish_weight_update")
        transfer_s = time.perf_counter() - transfer_began
        _finish_push(self.control, version)
        return SyncTimings(pause_s=0.0, transfer_s=transfer_s,
                           total_s=time.perf_counter() - began,
                           num_bytes=sum(s.num_bytes for s in specs))

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


class DiskWeightSync:
    """Write safetensors to a folder and ask the server to `reload_weights` from it.

    The folder must be readable by the server (same machine or shared storage). Only the
    latest version's folder is kept.
    """

    def __init__(self, control: ServerControl, work_dir: str | Path | None = None):
        self.control = control
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(
            prefix="grpo-agent-weights-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._last_folder: Path | None = None

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTimings:
        from safetensors.torch import save_file

        began = time.perf_counter()
        folder = self.work_dir / f"version-{version}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights}
        with stall.stage("weight_sync/transfer", version=version, folder=str(folder)):
            save_file(tensors, str(folder / "model.safetensors"))
            self.control.call("POST", "/collective_rpc",
                              json_body={"method": "reload_weights",
                                         "kwargs": {"weights_path": str(folder)}})
        transfer_s = time.perf_counter() - began
        _finish_push(self.control, version)
        if self._last_folder is not None and self._last_folder != folder:
            shutil.rmtree(self._last_folder, ignore_errors=True)
        self._last_folder = folder
        return SyncTimings(pause_s=0.0, transfer_s=transfer_s,
                           total_s=time.perf_counter() - began,
                           num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))

    def close(self) -> None:
        self.control.close()


def detect_backend(server_info: dict) -> str:
    """The backend a server supports, read from its weight-transfer config."""
    config = (server_info.get("vllm_config") or {}).get("weight_transfer_config")
    backend = config.get("backend") if isinstance(config, dict) else None
    return backend if backend in BACKENDS else "disk"


def build_weight_sync(base_url: str, *, backend: str | None = None,
                      work_dir: str | Path | None = None, timeout: float = 1800.0) -> WeightSync:
    """The weight sync for the server at `base_url`; `backend=None` asks the server."""
    control = ServerControl(base_url, timeout)
    if backend is None:
        backend = detect_backend(control.server_info())
        logger.info("weight sync backend for %s: %s", base_url, backend)
    if backend == "gloo":
        # A chunk is at most 256 MiB over local TCP: minutes mean the other side is gone.
        return GlooWeightSync(control, timeout=min(timeout, 300.0))
    if backend == "disk":
        return DiskWeightSync(control, work_dir)
    if backend == "nccl":
        from grpo_agent.sampler.nccl_sync import NcclWeightSync

        return NcclWeightSync(control, timeout=timeout)
    control.close()
    raise ValueError(f"Unknown weight sync backend {backend!r}; choose one of {BACKENDS}.")
