"""The weights the trainer pushes to vLLM: full tensors under the server's (Hugging Face) names.

Three things stand between a training model and the names a vLLM model loads:
- FSDP2 shards parameters as DTensors: every rank must take part in `full_tensor()` for every
  parameter, in the same order, even though only rank 0 sends. So the generator runs on every
  rank and the caller drains it on the others.
- PEFT wraps names (`base_model.model.` prefix, `.base_layer.` infix, `lora_*` leaves): for a
  merged push the adapters are merged into the base weights for the duration of the push and the
  wrapper parts of the names are removed.
- A vision-language model's vision tower and its multimodal projector (the layers that map
  image features into the text model's embedding space) are frozen here, so the server's copy
  never goes stale and pushing them would only cost time.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

VISION_TOWER_MARKERS = ("visual.", "vision_tower.", "vision_model.", "vision_encoder.")
# Projectors outside the tower (Qwen-VL's merger lives inside `visual.`): LLaVA, Gemma 3,
# Mistral 3, Llama 4, InternVL (`multi_modal_projector`), Idefics3/SmolVLM (`connector`).
PROJECTOR_MARKERS = ("multi_modal_projector.", "mm_projector.", "model.connector.")
_PEFT_PREFIX = "base_model.model."


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


def has_trained_adapter(model: nn.Module) -> bool:
    """Whether a LoRA adapter of `model` is not zero (a trained one was passed in): a fresh
    server then serves the base model, not this policy, until the weights are pushed. PEFT
    starts LoRA B at zero. Under FSDP every rank calls it (the ranks agree on their shards)."""
    from grpo_agent.train import fsdp

    nonzero = torch.tensor(float(any(
        bool(_local(param).abs().sum() > 0)
        for name, param in getattr(model, "module", model).named_parameters()
        if ".lora_B." in name)))
    if fsdp.world_size() > 1:
        torch.distributed.all_reduce(nonzero, op=torch.distributed.ReduceOp.MAX)
    return bool(nonzero.item())


# Elements per block of a fingerprint pass: its int64 copy is at most 128 MiB.
FINGERPRINT_BLOCK = 1 << 24
# Models whose weights the trainer loaded itself from the checkpoint they name, with the
# fingerprint they had then (`remember_loaded_weights`).
_AS_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_loaded_weights(model: nn.Module) -> None:
    """The trainer loaded `model` itself from the checkpoint it names, the one a fresh server
    loads: keep a fingerprint of its pushed weights for `served_weights_may_differ`. Under FSDP
    every rank keeps its shards'."""
    _AS_LOADED[getattr(model, "module", model)] = _fingerprint(model)


def served_weights_may_differ(model: nn.Module, holds_pushed_weights: bool) -> bool:
    """Whether the server may serve other (base) weights than `model`'s, so the trainer pushes
    them before its first rollout: a server an earlier run pushed into, or a fresh one (it
    loaded the checkpoint) while `model`'s weights are not known to be that checkpoint's. They
    are known only where the trainer loaded them itself and they did not change since
    (`remember_loaded_weights`), so an unchanged model is not pushed cold. A model object passed
    in may have been edited or fine-tuned in memory, and telling it from the checkpoint would
    mean reading the checkpoint, about what the push costs: it is pushed. The fingerprint reads
    the weights once where they are (the test model on CPU: 9.5 ms against 47-68 ms for its
    push; a 1.7B model: docs/vllm.md, "Weight sync"). Under FSDP every rank calls it (each
    compares its shards; the ranks agree)."""
    from grpo_agent.train import fsdp

    if holds_pushed_weights:
        return True
    loaded = _AS_LOADED.get(getattr(model, "module", model))
    changed = torch.tensor(float(loaded is None or _changed(loaded, _fingerprint(model))))
    if fsdp.world_size() > 1:
        torch.distributed.all_reduce(changed, op=torch.distributed.ReduceOp.MAX)
    return bool(changed.item())


def _fingerprint(model: nn.Module) -> list[torch.Tensor]:
    """The row and column sums of every pushed weight's raw bits, as integers: exact, so the
    same whatever the thread count or the order of the reduction, and changed by any edit
    short of one that keeps every row's and every column's sum."""
    sums = []
    with torch.no_grad():
        for name, param in getattr(model, "module", model).named_parameters():
            if not (_is_adapter_param(name) or is_vision_tower_param(name)):
                sums.extend(_bit_sums(_local(param.detach())))
    return sums


def _bit_sums(tensor: torch.Tensor) -> list[torch.Tensor]:
    if tensor.numel() == 0:
        return []
    bits = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}[bits.element_size()]
    bits = bits.contiguous().view(as_int)  # 8-byte elements as two int32s: no int64 overflow
    rows, columns = [], torch.zeros(bits.shape[1], dtype=torch.int64, device=bits.device)
    for block in bits.split(max(1, FINGERPRINT_BLOCK // bits.shape[1])):
        wide = block.to(torch.int64)
        rows.append(wide.sum(dim=1))
        columns += wide.sum(dim=0)
    return [torch.cat(rows), columns]


def _changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) != len(after) or not all(
        a.shape == b.shape and torch.equal(a, b.to(a.device)) for a, b in zip(before, after))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def is_vision_tower_param(name: str) -> bool:
    """Vision tower or multimodal projector: frozen, never pushed."""
    return any(marker in name for marker in VISION_TOWER_MARKERS + PROJECTOR_MARKERS)


def server_name(name: str) -> str:
    """The Hugging Face name of a parameter of a (possibly PEFT-wrapped) model."""
    name = name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def _is_adapter_param(name: str) -> bool:
    return ".lora_" in name or ".original_module." in name


@contextlib.contextmanager
def merged_adapters(model: nn.Module) -> Iterator[None]:
    """Merge LoRA adapters into the base weights for the block, then unmerge them."""
    if not is_peft_model(model):
        yield
        return
    with torch.no_grad():
        model.merge_adapter()
    try:
        yield
    finally:
        with torch.no_grad():
            model.unmerge_adapter()


def full_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (server name, full tensor) for every weight the server must receive.

    Tied parameters appear once (`named_parameters` de-duplicates); buffers such as rotary
    frequencies are not weights and are skipped. Call inside `merged_adapters(model)`.
    """
    for name, param in model.named_parameters():
        if _is_adapter_param(name) or is_vision_tower_param(name):
            continue
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor shard: a collective on every rank
            tensor = tensor.full_tensor()
        yield server_name(name), tensor


def lora_adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, under PEFT's saved names (for a server with --enable-lora)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
        for name, t in state.items()
    }
