"""Test kit shipped with the package (the way pytest ships `pytester`).

`build_tiny_model` gives every test, demo and benchmark the same locally built model, so
nothing downloads weights.
"""
from grpo_agent.testing.tiny_model import (
    EOS_TOKEN,
    KIT_VERSION,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_tiny_model,
    default_cache_dir,
)

__all__ = [
    "EOS_TOKEN", "KIT_VERSION", "PAD_TOKEN", "SPECIAL_TOKENS", "build_tiny_model",
    "default_cache_dir",
]
