"""What a server needs to serve this run's LoRA adapters: the rank, how many, whether at all.

Its own module because both sides read it: the server checks of train start and restores
(`train.setup.server_needs`) and the adapter pusher, whose refusals name the run's whole
server command (built from `server_needs`); in `adapter.py` the two imported each other.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from grpo_agent.train.weights import is_peft_model

# The values vLLM accepts for --max-lora-rank.
SERVER_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(model: nn.Module) -> int:
    """The largest rank of the active adapter (a `rank_pattern` may raise some layers' rank)."""
    config = active_config(model)
    return max([int(config.r), *(int(r) for r in (config.rank_pattern or {}).values())])


def unservable_reason(model: nn.Module) -> str | None:
    """Why vLLM cannot serve this PEFT adapter as a LoRA adapter, or None when it can."""
    config = active_config(model)
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        return f"the adapter is {kind}, and vLLM serves LoRA adapters only"
    if getattr(config, "use_dora", False):
        return "vLLM does not serve DoRA adapters (use_dora=True)"
    if config.modules_to_save:
        return (f"vLLM cannot load fully trained modules_to_save={sorted(config.modules_to_save)} "
                "from an adapter")
    return None


def server_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds an adapter of this rank."""
    return next((r for r in SERVER_LORA_RANKS if r >= rank), rank)


def needed_loras(max_staleness: int) -> int:
    """The --max-loras adapter sync needs: max_staleness + 1 live versions plus the next."""
    return max_staleness + 2


def server_lora_needs(model: nn.Module, max_staleness: int) -> tuple[int, int] | None:
    """The --max-lora-rank and --max-loras of a server that syncs this model as adapters, or
    None when it would get merged weights (no PEFT model, or one vLLM cannot serve)."""
    if not is_peft_model(model) or unservable_reason(model) is not None:
        return None
    return server_lora_rank(adapter_rank(model)), needed_loras(max_staleness)


def active_config(model: nn.Module) -> Any:
    """The PEFT config of the model's active adapter (FSDP or DDP wrapper unwrapped)."""
    model = getattr(model, "module", model)
    return model.peft_config[getattr(model, "active_adapter", "default")]
