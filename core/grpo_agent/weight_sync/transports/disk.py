"""`disk` weight sync: safetensors written to a folder, then `reload_weights` over
`/collective_rpc`, for servers started without a weight-transfer config."""
from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from grpo_agent import stall
from grpo_agent.weight_sync.transports.control import ServerControl, SyncTimings, finish_push


class DiskWeightSync:
    """Write safetensors to a folder and ask the server to `reload_weights` from it.

    The folder must be readable by the server (same machine or shared storage). Only the
    latest version's folder is kept.
    """

    def __init__(self, control: ServerControl, work_dir: str | Path | None = None):
        """`work_dir`: the caller's folder, left in place by `close`; None makes a temporary
        one (in /dev/shm where there is one) that `close` deletes."""
        self.control = control
        self._own_dir = not work_dir
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
        finish_push(self.control, version)
        if self._last_folder is not None and self._last_folder != folder:
            shutil.rmtree(self._last_folder, ignore_errors=True)
        self._last_folder = folder
        return SyncTimings(pause_s=0.0, transfer_s=transfer_s,
                           total_s=time.perf_counter() - began,
                           num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))

    def close(self) -> None:
        """The server has loaded the last version (`reload_weights` copies), so a temporary
        folder goes: left behind, each run kept a full copy of its weights in /dev/shm (RAM)."""
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        self.control.close()
