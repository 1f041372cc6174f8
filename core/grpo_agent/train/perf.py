"""Model FLOPs utilisation: a FLOPs estimate per architecture and a table of peak FLOP/s.

MFU is only honest when both halves are known, so both return None otherwise and the trainer
omits `perf/*_mfu` (as on CPU, whose peak depends on cores, clocks and vector units). FLOPs are
counted from the config (matmuls only, 3x forward for forward+backward, attention over the
tokens each position attends to), the way the PaLM appendix counts them.
"""
from __future__ import annotations

from typing import Any

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


def forward_flops_per_token(config: Any, context_len: float) -> float | None:
    """Matmul FLOPs of one token's forward pass attending over `context_len` tokens."""
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
    attention_scores = 2 * heads * head_dim * context_len  # QK^T and AV
    per_layer = 2 * (attn_proj + mlp) + 2 * attention_scores
    return cfg.num_hidden_layers * per_layer + 2 * d * cfg.vocab_size


def training_flops(config: Any, num_tokens: int, mean_context_len: float) -> float | None:
    """Forward + backward FLOPs for `num_tokens` tokens (backward counted as 2x forward)."""
    per_token = forward_flops_per_token(config, mean_context_len)
    return None if per_token is None else 3.0 * per_token * num_tokens


def mfu(flops: float | None, seconds: float, peak: float | None, num_devices: int = 1) -> float | None:
    if flops is None or peak is None or seconds <= 0:
        return None
    return flops / (seconds * peak * num_devices)
