"""An FSDP2 check run by fsdp_checks.py (2 processes, gloo, CPU): the loss metrics of a step under FSDP2 are
reduced over both processes' rows, as one process forwarding every row would compute them.

Rank r trains a row of r + 1 samples (16 trained tokens each), so the processes' rows differ
in size and values. The reference forwards both rows on one unsharded copy and takes each
metric over all 48 trained tokens. Rank 0 writes the comparison to `out_path` as JSON.
"""
import copy
import json

import torch
import torch.distributed as dist
from fsdp_worker import make_sample
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.testing import build_tiny_model
from grpo_agent.train.forward import forward_row
from grpo_agent.train.fsdp import apply_fsdp2, install_forward_method
from grpo_agent.train.loss import build_loss_config, metric_floats, row_loss
from grpo_agent.train.packing import pack_row
from grpo_agent.train.step_rows import StepRows
from grpo_agent.train.tree_attention import enable_tree_attention
from transformers import AutoModelForCausalLM


def reference_metrics(model, rows, cfg) -> dict[str, float]:
    """Each metric over the trained tokens of all rows, from one process's forward."""
    with torch.no_grad():
        tokens = [forward_row(model, row, temperature=1.0).token for row in rows]
    logp = torch.cat([t.logprobs for t in tokens])
    sampler = torch.cat([row.sampler_logprobs for row in rows])
    ratio, diff = torch.exp(logp - sampler), (logp - sampler).abs()
    masked = (ratio < cfg.clip_min) | (ratio > cfg.clip_max)
    return {
        "sampling/sampling_logp_difference/mean": diff.mean().item(),
        "sampling/sampling_logp_difference/max": diff.max().item(),
        "sampling/importance_sampling_ratio/min": ratio.min().item(),
        "sampling/importance_sampling_ratio/mean": ratio.mean().item(),
        "sampling/importance_sampling_ratio/max": ratio.max().item(),
        "sampling/masked_mean": masked.float().mean().item(),
        "entropy": torch.cat([t.entropy for t in tokens]).mean().item(),
    }


def check(out_path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
    enable_tree_attention(model)
    reference = copy.deepcopy(model)
    cfg = build_loss_config(AsyncGRPOConfig(output_dir="/tmp/unused", score_centering=False,
                                            vllm_importance_sampling_clip_max=1.02))
    rows = [pack_row([make_sample(10 * r + i, r) for i in range(r + 1)]) for r in range(world)]
    total = sum(r.num_trained for r in rows)
    expected = reference_metrics(reference, rows, cfg)
    ref_loss = sum(row_loss(reference, row, cfg, total)[0].item() for row in rows)

    apply_fsdp2(model)
    install_forward_method(model, "grpo_row_loss", row_loss)
    loss, metrics = model.grpo_row_loss(rows[rank], cfg, total)
    step = StepRows()
    step.add_metrics(metrics, rows[rank].num_trained)
    step.add_loss(loss * world)  # as the trainer's compute_loss returns it
    reading = step.read(torch.device("cpu"), world)
    if rank == 0:
        result = {"world": world, "trained": [r.num_trained for r in rows],
                  "metrics": reading.metrics, "expected": expected,
                  "rank0_only": metric_floats(metrics),
                  "loss": reading.loss, "reference_loss": ref_loss}
        with open(out_path, "w") as fh:
            json.dump(result, fh)
