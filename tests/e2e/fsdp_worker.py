"""An FSDP2 check run by fsdp_checks.py (2 processes, gloo, CPU): the row loss equals one
process's, and the push.

Each rank trains its own packed row of the same micro-batch; the reference is one unsharded
copy of the model that forwards both rows. Rank 0 writes the comparison to `out_path` as JSON.
"""
import copy
import json

import torch
import torch.distributed as dist
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.testing import build_tiny_model
from grpo_agent.train.fsdp import apply_fsdp2, install_forward_method
from grpo_agent.train.loss import build_loss_config, row_loss
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import enable_tree_attention
from grpo_agent.train.weights import full_weights
from grpo_agent.types import TrainingSample, TrainingSequence
from transformers import AutoModelForCausalLM


def make_sample(seed: int, group: int) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (24,), generator=g).tolist()
    mask = [0] * 8 + [1] * 16
    logps = [0.0] * 8 + (-7.6 + 0.2 * torch.rand(16, generator=g)).tolist()  # near uniform
    return TrainingSample(TrainingSequence(ids, mask, logps), advantage=1.0 - 2 * (seed % 2),
                          model_version=0, group_id=group, row_index=group, prompt_index=group)


def check(out_path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
    enable_tree_attention(model)
    reference = copy.deepcopy(model)
    cfg = build_loss_config(AsyncGRPOConfig(output_dir="/tmp/unused", score_centering=False))
    rows = [pack_row([make_sample(2 * r, r), make_sample(2 * r + 1, r)]) for r in range(world)]
    total = sum(r.num_trained for r in rows)

    ref_loss = sum(row_loss(reference, row, cfg, total)[0] for row in rows)
    ref_loss.backward()

    apply_fsdp2(model)
    install_forward_method(model, "grpo_row_loss", row_loss)
    loss, _ = model.grpo_row_loss(rows[rank], cfg, total)
    (loss * world).backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)

    grad_errors = {}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grad_errors[name] = (grad - ref_params[name].grad).abs().max().item()
    pushed = {name: t.clone() for name, t in full_weights(model)}
    weight_errors = {n: (t - ref_params[n].detach()).abs().max().item() for n, t in pushed.items()}
    if rank == 0:
        result = {
            "world": world,
            "loss": summed.item(), "reference_loss": ref_loss.item(),
            "max_grad_error": max(grad_errors.values()),
            "max_grad": max(p.grad.abs().max().item() for p in reference.parameters()),
            "pushed_names_match": sorted(pushed) == sorted(ref_params),
            "max_weight_error": max(weight_errors.values()),
            "sharded": type(next(model.parameters())).__name__,
        }
        with open(out_path, "w") as fh:
            json.dump(result, fh)
