"""Copies of a row's CPU tensors to the training device that do not stall the host.

Design decision: a copy from ordinary (pageable) host memory first synchronises the stream,
so the host waits until the GPU has run everything queued before it. Between the rows of an
optimizer step that leaves the GPU idle while the host queues the next row's kernels (on an
H200 the compiled packed step is bound by that queueing). On CUDA the tensors go through
pinned memory instead (PyTorch's caching host allocator keeps each pinned block until its
copy has run) with `non_blocking=True`, so the host queues row i+1 while the GPU runs row i.
"""

from __future__ import annotations

import torch


def to_device(device: torch.device | str, *tensors: torch.Tensor | None) -> list:
    """Each tensor (or None) on `device`; on CUDA without waiting for the GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return [None if t is None else t.to(device) for t in tensors]
    return [
        None if t is None else (t.pin_memory() if t.device.type == "cpu" else t).to(
            device, non_blocking=True
        )
        for t in tensors
    ]
