"""FSDP2 for several trainer processes: `fully_shard` each decoder block, then the root.

We shard the model ourselves instead of through accelerate's FSDP plugin because the same code
must run under `torchrun` on CPU with gloo (CI) and on GPUs with NCCL; transformers refuses its
FSDP path on CPU. Blocks are the unit of all-gather (torchtitan's layout); the mixed-precision
policy is explicit: parameters compute in the training precision, gradients reduce in fp32.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Rank 0 of the process group; outside one (before it starts, after the run leaves it) the
    launcher's RANK, so a torchrun's end-of-run lines still print once."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def quiet_other_ranks() -> None:
    """Ranks > 0 log errors only: every rank runs the same start-up checks (server dtype,
    missing routes) and steps, so their warnings would print once per rank."""
    if not is_main_process():
        logging.getLogger("grpo_agent").setLevel(logging.ERROR)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the `ModuleList` with the most children)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks to shard; FSDP2 here needs a "
            "decoder-only transformer (model.model.layers)."
        )
    return list(max(lists, key=len))


def apply_fsdp2(model: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard `model` in place across the default process group; returns it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    logger.info("FSDP2: sharded %s over %d processes", type(model).__name__, world_size())
    return model


def install_forward_method(model: nn.Module, name: str, function) -> None:
    """Make `model.<name>(...)` call `function(model, ...)` as if it were the model's forward.

    The packed loss runs the decoder and applies the LM head weight itself (no full logits), so
    the root's `forward` never runs and FSDP2 would neither gather the root's parameters (embed,
    norm, LM head) nor reduce their gradients. Registering the loss as a forward method gives it
    the root's pre/post-forward hooks.
    """
    import types

    setattr(model, name, types.MethodType(function, model))
    if hasattr(model, "unshard"):  # an FSDPModule
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, name)


# Checkpoints of a sharded model: the Trainer's own save/load paths assume unsharded tensors
# (safetensors cannot read a DTensor's storage, and optimizer.pt would hold rank 0's shard only).
# Every rank joins the gather; rank 0 ends up with full tensors on the CPU and writes them, so a
# checkpoint is the same files as an unsharded run's and loads in either.


def _full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model: nn.Module) -> dict:
    """Collective: the unsharded state dict on rank 0 (CPU), `{}` on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: the optimizer state keyed by parameter name, full on rank 0, `{}` elsewhere."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict) -> None:
    """Load an unsharded state dict (every rank holds it) into the sharded model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # Missing keys are found before loading: with full_state_dict, set_model_state_dict fills a
    # key the checkpoint lacks with the model's current tensor (in `state` itself), so its
    # result never reports one.
    tied = _tied_parameter_names(model)
    missing = [k for k in model.state_dict() if k not in state and k not in tied]
    result = set_model_state_dict(model, state, options=_full_options(strict=False))
    if missing or result.unexpected_keys:
        raise ValueError(
            f"The checkpoint does not fit the model: missing {missing[:5]}, unexpected "
            f"{list(result.unexpected_keys)[:5]}. Resume with the model the run was started with."
        )


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_full_options())


def _tied_parameter_names(model: nn.Module) -> set[str]:
    """Names under which a parameter appears a second time (a tied LM head)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.setdefault(id(param), name)
    return tied
