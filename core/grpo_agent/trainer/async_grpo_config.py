"""Alias of `trl.trainer.async_grpo_config`: the same `AsyncGRPOConfig`, not a copy."""
from grpo_agent.config import AsyncGRPOConfig

__all__ = ["AsyncGRPOConfig"]
