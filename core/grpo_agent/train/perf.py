"""Model FLOPs utilisation: a FLOPs estimate per architecture and a table of peak FLOP/s.

MFU is only honest when both halves are known, so both return None otherwise and the trainer
omits `perf/*_mfu` (as on CPU, whose peak depends on cores, clocks and vector units). FLOPs are
counted from the config, matmuls only and 3x forward for forward+backward as in the PaLM
appendix, for the work a packed row really does: projections and MLP at every forwarded
(unique) token, attention over the query-key pairs the tree makes visible (a token sees the
depth + 1 tokens of its path, fewer on a sliding-window layer), and the LM head only at the
positions that predict a trained token (the loss never builds the other logits).
"""
from __future__ import annotations

from typing import Any

import torch

# Dense peak FLOP/s per device (SXM parts) for each training precision; fp32 counts TF32 off.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12},
}

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text"}


def peak_flops_per_s(device_name: str | None, precision: str) -> float | None:
    """The table's peak for a CUDA device name such as 'NVIDIA H200'; None when unknown."""
    if not device_name:
        return None
    for key, by_precision in PEAK_FLOPS.items():
        if key in device_name.upper():
            return by_precision.get(precision)
    return None


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _sliding_windows(cfg: Any) -> list[int | None]:
    """Per layer, the attention window the model applies (None: the whole path)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [window] * cfg.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def forward_flops(config: Any, depths: torch.Tensor, num_trained: int) -> float | None:
    """Matmul FLOPs of one packed row's forward: `depths` is each forwarded token's depth in
    its sample (the row's `position_ids`), `num_trained` the positions the LM head runs at."""
    cfg = _text_config(config)
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    d = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    attn_proj = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2
    experts_per_token = getattr(cfg, "num_experts_per_tok", None)
    if experts_per_token:
        mlp = 3 * d * cfg.moe_intermediate_size * experts_per_token + d * cfg.num_experts
    else:
        mlp = 3 * d * cfg.intermediate_size
    keys = depths.to(torch.int64) + 1  # keys each token attends to: its path
    pairs = {w: int((keys if w is None else keys.clamp(max=w)).sum())
             for w in set(_sliding_windows(cfg))}
    per_pair = 4 * heads * head_dim  # QK^T and AV, 2 FLOPs per multiply-add
    layers = sum(2 * (attn_proj + mlp) * len(depths) + per_pair * pairs[w]
                 for w in _sliding_windows(cfg))
    return float(layers + 2 * d * cfg.vocab_size * num_trained)


def training_flops(config: Any, depths: torch.Tensor, num_trained: int) -> float | None:
    """Forward + backward FLOPs of one packed row (backward counted as 2x forward)."""
    forward = forward_flops(config, depths, num_trained)
    return None if forward is None else 3.0 * forward


def packed_training_flops(config: Any, rows: list) -> float | None:
    """Forward + backward FLOPs of packed rows (`PackedRow`s), summed."""
    flops = [training_flops(config, row.position_ids, row.num_trained) for row in rows]
    return None if None in flops else float(sum(flops))


def mfu(flops: float | None, seconds: float, peak: float | None, num_devices: int = 1) -> float | None:
    if flops is None or peak is None or seconds <= 0:
        return None
    return flops / (seconds * peak * num_devices)
