"""Push trainer weights into a running vLLM server: one call, "these weights are version N".

Design decision: the trainer knows one narrow interface (`WeightSync.push`) and never which
transport runs underneath. `build_weight_sync` reads the server's own configuration
(`GET /server_info?config_format=json`) and picks:

- `gloo` (`gloo.py`): bytes over a private gloo group to our CPU weight-transfer engine
  (`inside_vllm/gloo_engine.py`);
- `nccl` (`nccl.py`): vLLM's NCCL engine for GPU servers;
- `disk` (`disk.py`): safetensors written to a folder, then `reload_weights` over
  `/collective_rpc`, for servers started without a weight-transfer config.

All of them end a push the same way (`control.finish_push`).
"""
from __future__ import annotations

import logging
from pathlib import Path

from grpo_agent.sampler.server_facts import WEIGHT_TRANSFER_BACKENDS, detect_backend
from grpo_agent.weight_sync.transports.control import ServerControl, WeightSync
from grpo_agent.weight_sync.transports.disk import DiskWeightSync
from grpo_agent.weight_sync.transports.gloo import GlooWeightSync

logger = logging.getLogger(__name__)


def server_backend(base_url: str, timeout: float) -> str:
    """The weight-transfer backend the server at `base_url` is configured for, asked now."""
    with ServerControl(base_url, timeout) as control:
        return detect_backend(control.server_info())


def build_weight_sync(base_url: str, *, backend: str | None = None,
                      work_dir: str | Path | None = None, timeout: float = 1800.0) -> WeightSync:
    """The weight sync for the server at `base_url`; `backend=None` asks the server (the
    trainer passes its `ServerFacts.weight_transfer_backend` instead)."""
    if backend is None:
        backend = server_backend(base_url, timeout)
        logger.info("weight sync backend for %s: %s", base_url, backend)
    control = ServerControl(base_url, timeout)
    if backend == "gloo":
        # A chunk is at most 256 MiB over local TCP: minutes mean the other side is gone.
        return GlooWeightSync(control, timeout=min(timeout, 300.0))
    if backend == "disk":
        return DiskWeightSync(control, work_dir)
    if backend == "nccl":
        from grpo_agent.weight_sync.transports.nccl import NcclWeightSync  # needs a GPU vLLM

        return NcclWeightSync(control, timeout=timeout)
    control.close()
    raise ValueError(f"Unknown weight sync backend {backend!r}; choose one of {WEIGHT_TRANSFER_BACKENDS}.")
