"""FSDP2 trainer step on GPUs: one process vs `torchrun --nproc_per_node N` with `fully_shard`.

The trainer half only (no vLLM on the GPU box): a stand-in sample source makes GRPO-shaped
samples (groups sharing a prompt), the real step planner packs them into token-budget rows, and
the real packed loss runs through the FSDP2 forward method the trainer installs. Prints one JSON
line per rank-0 measurement; the last line is the summary of this launch (compare the N=1 and
N=2 launches' `trained_tokens_per_s`; the 2-GPU launch also checks its first-step loss against
one unsharded process).

Usage: torchrun --nproc_per_node 2 bench/fsdp2_gpu.py [--steps 10]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import time

import torch
import torch.distributed as dist
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train import perf
from grpo_agent.train.batching import plan_step
from grpo_agent.train.fsdp import apply_fsdp2, install_forward_method
from grpo_agent.train.loss import build_loss_config, row_loss
from grpo_agent.train.tree_attention import enable_tree_attention
from grpo_agent.types import TrainingSample, TrainingSequence

PROMPT_LEN, COMPLETION_LEN, GROUP = 256, 768, 8
TOKEN_BUDGET = 8192


def build_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def stand_in_samples(step: int, num_groups: int) -> list[TrainingSample]:
    """GRPO-shaped samples: each group repeats its prompt, completions differ."""
    rng = random.Random(step)
    samples = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, 32000) for _ in range(PROMPT_LEN)]
        for i in range(GROUP):
            completion = [rng.randrange(3, 32000) for _ in range(COMPLETION_LEN)]
            ids = prompt + completion
            mask = [0] * PROMPT_LEN + [1] * COMPLETION_LEN
            logps = [0.0] * PROMPT_LEN + [-10.4] * COMPLETION_LEN  # ~uniform over 32k
            samples.append(TrainingSample(TrainingSequence(ids, mask, logps),
                                          advantage=rng.choice([-1.0, 1.0]), model_version=0,
                                          group_id=step * 1000 + g, row_index=g, prompt_index=g))
    return samples


def train_step(model, optimizer, samples, cfg, rank, world):
    plan = plan_step(samples, token_budget=TOKEN_BUDGET, num_processes=world, grad_accum_steps=1)
    rows = plan.microbatches[0]
    loss, _ = model.grpo_row_loss(rows[rank], cfg, plan.trained_tokens(0))
    (loss * world).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    summed = loss.detach().clone()
    if world > 1:
        dist.all_reduce(summed)
    flops = perf.packed_training_flops(model.config, rows)  # every process's rows
    return summed.item(), sum(r.num_tokens for r in rows), plan.trained_tokens(0), flops


def reference_loss(model, samples, cfg, world) -> float:
    """The same micro-batch's loss on one unsharded copy (all rows), for the equality check."""
    plan = plan_step(samples, token_budget=TOKEN_BUDGET, num_processes=world, grad_accum_steps=1)
    with torch.no_grad():
        return sum(row_loss(model, row, cfg, plan.trained_tokens(0))[0].item()
                   for row in plan.microbatches[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    opts = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    model = build_model().to(device)
    enable_tree_attention(model)
    cfg = build_loss_config(AsyncGRPOConfig(output_dir="/tmp/unused", score_centering=False,
                                            vllm_importance_sampling_clip_min=1e-3,
                                            vllm_importance_sampling_clip_max=1e3))
    groups = 2 * world  # about one row per GPU: TOKEN_BUDGET holds ~1.3 groups
    check = None
    if world > 1:
        reference = copy.deepcopy(model)
        ref = reference_loss(reference, stand_in_samples(0, groups), cfg, world)
        del reference
        apply_fsdp2(model, param_dtype=torch.bfloat16)
    else:
        ref = None
    install_forward_method(model, "grpo_row_loss", row_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    times, tokens, trained, flops = [], [], [], []
    for step in range(opts.steps + 3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss, fwd_tokens, trained_tokens, step_flops = train_step(
            model, optimizer, stand_in_samples(step, groups), cfg, rank, world)
        torch.cuda.synchronize()
        if step == 0 and ref is not None:
            check = {"fsdp_loss": loss, "unsharded_fp32_loss": ref}
        if step >= 3:
            times.append(time.perf_counter() - started)
            tokens.append(fwd_tokens)
            trained.append(trained_tokens)
            flops.append(step_flops)
    if rank == 0:
        seconds = sum(times)
        peak = perf.peak_flops_per_s(torch.cuda.get_device_name(), "bf16" if world > 1 else "fp32")
        print(json.dumps({
            "summary": "fsdp2_gpu", "world": world, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,  # DTensor numel is global
            "step_s": seconds / len(times), "trained_tokens_per_s": sum(trained) / seconds,
            "forwarded_tokens_per_s_per_gpu": sum(tokens) / seconds / world,  # all rows / GPUs
            "mfu": perf.mfu(sum(flops), seconds, peak, world),
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            **({"loss_check": check} if check else {}),
        }))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
