"""Wire format shared by both ends of the gloo weight transfer (trainer and vLLM worker).

The trainer is rank 0 of a private gloo group opened on its own TCPStore, so neither side's
global `torch.distributed` state is touched. Parameters travel as raw bytes, packed into
uint8 buffers of at most `chunk_bytes`; both ends derive the same chunk plan from the
(name, dtype, shape) list the trainer sends over HTTP, so only bytes cross the group.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
_STORE_PREFIX = "grpo_agent_weights"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype_name: str  # torch attribute name, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def plan_chunks(specs: list[TensorSpec], chunk_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of specs whose bytes fit in one buffer (a big tensor goes alone)."""
    chunks: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for spec in specs:
        if current and current_bytes + spec.num_bytes > chunk_bytes:
            chunks.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += spec.num_bytes
    if current:
        chunks.append(current)
    return chunks


@dataclass
class PackedWeights:
    """One push's weights copied into wire chunks: a snapshot the trainer may train past."""

    version: int
    specs: list[TensorSpec]
    chunks: list[torch.Tensor]


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """Join the private gloo group; rank 0 hosts the TCPStore. Returns (store, group)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore(_STORE_PREFIX, store), rank, world_size,
                                  timeout)
    return store, group


def broadcast_from_trainer(group, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([buffer], options).wait()


def pack(chunk: list[TensorSpec], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Concatenate the chunk's tensors as raw bytes (the trainer side)."""
    parts = [tensors[spec.name].detach().to("cpu").contiguous().view(-1).view(torch.uint8)
             for spec in chunk]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unpack(chunk: list[TensorSpec], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buffer`, one per spec (the worker side)."""
    out, offset = [], 0
    for spec in chunk:
        raw = buffer[offset:offset + spec.num_bytes]
        out.append((spec.name, raw.view(spec.dtype).view(spec.shape)))
        offset += spec.num_bytes
    return out
