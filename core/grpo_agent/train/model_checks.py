"""The spec's refusals about the model itself, checked once when the trainer is built.

Each case would otherwise train silently wrong rather than fail: an adapter on `lm_head` is
never trained (the loss reads the LM head's base weight: `forward.forward_row`), a router
coefficient on a dense model is ignored, and a final-logit softcap is not applied by our
log-prob kernel. Attention softcapping and attention sinks are refused by
`tree_attention.enable_tree_attention`, which owns what tree attention can compute.
"""
from __future__ import annotations

from torch import nn

from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train.forward import is_moe


def refuse_unsupported_model(model: nn.Module, args: AsyncGRPOConfig) -> None:
    """Raise ValueError naming the setting to change; `model` as trained (PEFT-wrapped)."""
    head = model.get_output_embeddings()
    if head is not None and any(type(m).__module__.startswith("peft.") for m in head.modules()):
        raise ValueError(
            f"The PEFT adapter targets lm_head ({type(head).__name__}): adapters on lm_head are "
            "not supported, as the loss reads the LM head's base weight and the adapter would "
            "never train. Remove 'lm_head' from the LoraConfig's target_modules (and "
            "modules_to_save)."
        )
    _refuse_unmatched_lora_targets(model)
    if args.router_aux_loss_coef is not None and not is_moe(model):
        raise ValueError(
            f"router_aux_loss_coef={args.router_aux_loss_coef} is set but "
            f"{type(model).__name__} has no router (not a mixture-of-experts model: its config "
            "has neither num_experts nor num_local_experts). Leave router_aux_loss_coef unset "
            "(None) for this model."
        )
    final_softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if final_softcap:
        raise ValueError(
            f"{type(model).__name__} caps its final logits (final_logit_softcapping="
            f"{final_softcap}, e.g. Gemma 2), which the trainer's log-prob kernel does not "
            "apply: its log-probs would not match the model's. Train a model without logit "
            "softcapping."
        )


PEFT_PARTS = ("base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A",
              "lora_embedding_B", "lora_magnitude_vector")


def _refuse_unmatched_lora_targets(model: nn.Module) -> None:
    """PEFT adapts the target_modules names that match and raises only when none does, so a
    misspelt name (`--lora-target-modules q_proj,v_prj`) trained an adapter without it, silently.
    A regex or `all-linear` (a string) is PEFT's to match."""
    targeted = getattr(model, "targeted_module_names", None)
    configs = getattr(model, "peft_config", None)
    if targeted is None or not isinstance(configs, dict):
        return
    for config in configs.values():
        names = getattr(config, "target_modules", None)
        if not isinstance(names, set | list | tuple):
            continue
        unmatched = sorted(name for name in names
                           if not any(key == name or key.endswith(f".{name}") for key in targeted))
        if unmatched:
            linear = sorted({_leaf(key) for key, module in model.named_modules()
                             if isinstance(module, nn.Linear) and _leaf(key) != "lm_head"})
            raise ValueError(
                f"LoRA target_modules {', '.join(unmatched)} match no module of the model, so the "
                f"adapter would train without them. Its linear layers are named: "
                f"{', '.join(linear)}; name those (--lora-target-modules q_proj,v_proj) or use "
                "all-linear.")


def _leaf(key: str) -> str:
    """A module's own name, PEFT's wrapper parts (`q_proj.base_layer`, `lora_A.default`) left out."""
    parts = [part for part in key.split(".") if part not in PEFT_PARTS and part != "default"]
    return parts[-1] if parts else key
