"""Forward one packed row through a transformers causal LM and read trained-token log-probs.

Design decision: we call the model's decoder (`get_decoder()`), not the LM wrapper, so the
[tokens x vocab] logits are never built; the LM head weight is then applied only at the
positions that predict a trained token, through the tiled log-sum-exp of `logprobs.py`.
The row's `TreeMask` reaches every attention layer through the forward kwargs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from grpo_agent.train import gated_deltanet
from grpo_agent.train.logprobs import TokenLogprobs, token_logprobs
from grpo_agent.train.packing import PackedRow
from grpo_agent.train.transfer import to_device
from grpo_agent.train.tree_attention import ATTN_IMPLEMENTATION, TreeMask


@dataclass
class RowForward:
    """What the loss needs from one row's forward pass."""

    token: TokenLogprobs
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss (before the coefficient)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def attention_head_dim(config) -> int | None:
    """The attention heads' width (a hybrid's full-attention layers), None if unknown."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None)
    heads, hidden = (getattr(text, k, None) for k in ("num_attention_heads", "hidden_size"))
    return head_dim or (hidden // heads if heads and hidden else None)


def forward_hidden(
    model, row: PackedRow, *, output_router_logits: bool = False, backend: str = "auto"
):
    """Decoder output for the row: (hidden states [N, H], router logits or None)."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            "The model is not in tree-attention mode: call "
            "grpo_agent.train.tree_attention.enable_tree_attention(model) once after loading it."
        )
    param = next(model.parameters())
    (input_ids,) = to_device(param.device, row.input_ids)
    tree = TreeMask.build(row, param.device, backend, dtype=param.dtype,
                          head_dim=attention_head_dim(model.config))
    tree.linear = gated_deltanet.build_plan(model, row, param.device)
    kwargs = {"output_router_logits": True} if output_router_logits else {}
    out = model.get_decoder()(
        input_ids=input_ids[None],
        position_ids=tree.position_ids[None],
        use_cache=False,
        tree_mask=tree,
        **kwargs,
    )
    gated_deltanet.check_calls(model, tree.linear)
    router = getattr(out, "router_logits", None) if output_router_logits else None
    return out.last_hidden_state[0], router


def forward_row(
    model, row: PackedRow, *, temperature: float, with_aux_loss: bool = False, backend: str = "auto"
) -> RowForward:
    """Trainer log-probs (and entropy, top-k log-probs, aux loss) for the row's trained tokens."""
    device = _model_device(model)
    # Copied before the forward is queued (`transfer`): with a pageable copy queued behind
    # the decoder, the GPU idled while the host queued the rest of the step.
    pred_index, targets, topk_ids, candidates = to_device(
        device, row.pred_index, row.targets, row.sampler_topk_ids, row.sampling_mask
    )
    hidden, router = forward_hidden(model, row, output_router_logits=with_aux_loss, backend=backend)
    token = token_logprobs(
        hidden[pred_index],
        model.get_output_embeddings().weight,
        targets,
        temperature=temperature,
        topk_ids=topk_ids,
        candidates=candidates,
    )
    aux = _load_balancing_loss(model, router) if with_aux_loss and router is not None else None
    return RowForward(token=token, aux_loss=aux)


def is_moe(model) -> bool:
    return getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0)


def _load_balancing_loss(model, router_logits) -> torch.Tensor:
    """The model family's own load-balancing loss function (e.g. Qwen3-MoE's)."""
    family = sys.modules[type(model).__module__]
    loss_fn = getattr(family, "load_balancing_loss_func", None)
    if loss_fn is None:
        raise ValueError(
            f"{type(model).__name__} returns router logits but its module has no "
            "load_balancing_loss_func; set router_aux_loss_coef=0 to train without the aux loss."
        )
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", 2)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return loss_fn(router_logits, experts, top_k, None)
