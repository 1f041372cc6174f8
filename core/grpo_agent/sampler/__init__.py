"""The async sampler client and the managed vLLM server (weight sync is `grpo_agent.weight_sync`).

The client and server modules import no torch, so the rollout worker stays light.
"""
from grpo_agent.sampler.client import ModelInfo, SamplerClient, SamplingParams
from grpo_agent.sampler.errors import (
    RequestRejectedError,
    SamplerError,
    ServerStartupError,
    ServerUnreachableError,
    WeightSyncError,
)
from grpo_agent.sampler.prometheus import ServerMetrics

__all__ = [
    "ModelInfo", "RequestRejectedError", "SamplerClient", "SamplerError", "SamplingParams",
    "ServerMetrics", "ServerStartupError", "ServerUnreachableError", "WeightSyncError",
]
