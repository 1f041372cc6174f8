"""`nccl` weight sync for GPU servers, through vLLM's own NCCL trainer engine.

UNTESTED here: no GPU build of vLLM was available while writing it (see docs/vllm.md). It is
written against vLLM 0.32's trainer-side API (`NCCLTrainerInitInfo`,
`WeightTransferTrainerFactory.trainer_init`, `HTTPVLLMWeightSyncClient`), which opens the
trainer as rank 0 of a fresh NCCL group with the server's workers and drives the server's
start/update/finish routes itself. vLLM's engine wants a re-iterable `WeightSource`; ours
holds the tensors of the current push.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from grpo_agent.weight_sync.transports.control import ServerControl, SyncTimings, finish_push


class _PushSource(WeightSource):
    """The tensors of one push, replayed by vLLM's engine in metadata order."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


class NcclWeightSync:
    """Rank-0 trainer sender for a server started with `{"backend": "nccl"}`."""

    def __init__(self, control: ServerControl, *, master_address: str | None = None,
                 timeout: float = 1800.0):
        self.control = control
        self.master_address = master_address or socket.gethostbyname(socket.gethostname())
        self.timeout = timeout
        self._source = _PushSource()
        self._engine = None

    def _connect(self) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        init_info = NCCLTrainerInitInfo(
            master_address=self.master_address, master_port=port,
            world_size=1 + self.control.worker_count(), rank=0,
        )
        client = HTTPVLLMWeightSyncClient(self.control.base_url, timeout=self.timeout)
        self._engine = WeightTransferTrainerFactory.trainer_init(
            init_info, client=client, source=self._source)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTimings:
        began = time.perf_counter()
        if self._engine is None:
            self._connect()
        device = torch.device("cuda", torch.cuda.current_device())
        self._source.tensors = [(name, t.detach().to(device)) for name, t in weights]
        transfer_began = time.perf_counter()
        self._engine.send_weights()
        transfer_s = time.perf_counter() - transfer_began
        num_bytes = sum(t.numel() * t.element_size() for _, t in self._source.tensors)
        self._source.tensors = []
        finish_push(self.control, version)
        return SyncTimings(pause_s=0.0, transfer_s=transfer_s,
                           total_s=time.perf_counter() - began, num_bytes=num_bytes)

    def reopen(self) -> None:
        """Forget the engine (its server died): the next push opens one with the new server."""
        self._engine = None

    def close(self) -> None:
        if self._engine is not None:
            self.control.call("POST", "/shutdown_weight_transfer_engine")
            self._engine = None
        self.control.close()
