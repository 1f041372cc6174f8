"""Everything that talks to vLLM: the async sampler client, the managed server, weight sync.

The client and server modules import no torch, so the rollout worker stays light; weight sync
(`grpo_agent.sampler.weight_sync`) is imported only by the trainer.
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
