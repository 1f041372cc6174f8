"""vLLM worker side of the `gloo` weight-transfer backend (CPU servers).

vLLM's own engines (nccl, ipc) need CUDA. This one receives weights over a private gloo group
and loads them with `model.load_weights` inside vLLM's layerwise-reload lifecycle, which
handles the CPU repacking and qkv/gate-up fusion. The whole reload runs inside the single
`update_weights` RPC (start/finish are no-ops): the engine core runs RPCs between scheduler
steps, so no forward pass ever sees a half-loaded model, and pushes are safe while requests
run. (Spreading the reload over vLLM's three RPCs under load killed the worker in our probe.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_agent.weight_sync.wire import (
    DEFAULT_CHUNK_BYTES,
    TensorSpec,
    broadcast_from_trainer,
    open_group,
    plan_chunks,
    unpack,
)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, d, tuple(s))
                for n, d, s in zip(self.names, self.dtype_names, self.shapes, strict=True)]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.chunk_bytes = DEFAULT_CHUNK_BYTES

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.chunk_bytes = init_info.chunk_bytes
        self.store, self.group = open_group(
            init_info.master_address, init_info.master_port,
            init_info.rank_offset + worker_rank, init_info.world_size, init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        """No-op: the reload happens atomically inside `receive_weights`."""

    def finish_weight_update(self) -> None:
        """No-op: see `start_weight_update`."""

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(); a CPU worker has nothing
        # to synchronize, and gloo's wait() already completed the transfer.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if self.group is None:
            raise RuntimeError("gloo weight transfer used before /init_weight_transfer_engine")
        initialize_layerwise_reload(self.model)
        try:
            for chunk in plan_chunks(update_info.specs(), self.chunk_bytes):
                buffer = torch.empty(sum(spec.num_bytes for spec in chunk), dtype=torch.uint8)
                broadcast_from_trainer(self.group, buffer)
                self.model.load_weights(unpack(chunk, buffer))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None
        self.store = None
