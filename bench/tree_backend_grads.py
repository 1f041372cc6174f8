"""Gradients of each tree-attention path against a float32 dense-mask reference, per parameter.

Why: the packing bench compares a path's gradients with another bf16 path's; when two paths
disagree, this says which one is off. One packed row of the packing bench (random Qwen3-0.6B
shape with fewer layers, G groups sharing 1024-token prompts), loss = sum of advantage x
log-prob. The reference is the float32 model on the "sdpa" path (the row's dense [N, N] mask);
each bf16 path's error is ||g - ref|| / ||ref|| per parameter (largest and overall), next to
the bf16 dense-mask path's own error (the precision floor). `--compile` compiles the bf16
models' decoder layers as the trainer does (level attention is one custom op there; traced
as an autograd.Function its gradients were wrong on an H200: docs/performance.md).

    PYTHONPATH=core python3 bench/tree_backend_grads.py --layers 4 [--compile]
"""

from __future__ import annotations

import argparse
import json

import torch
from grpo_agent.train import level_attention
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.regional_compile import compile_decoder_layers
from grpo_agent.train.tree_attention import enable_tree_attention
from packing import SHAPES, make_samples
from transformers import Qwen3Config, Qwen3ForCausalLM

# (label, backend, level_attention.DENSE)
PATHS = [("sdpa_bf16", "sdpa", None), ("varlen", "varlen", None),
         ("levels_cudnn_depth", "levels", "auto"), ("levels_flash", "levels", "off")]


def grads_of(model, row, backend):
    model.zero_grad(set_to_none=True)
    lp = forward_row(model, row, temperature=1.0, backend=backend).token.logprobs
    (lp.float() * row.advantages.to(lp.device)).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach().float(), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    kwargs, _, prompt_len, completion_len, budget = SHAPES["qwen3-0.6b"]
    cfg = Qwen3Config(**{**kwargs, "num_hidden_layers": args.layers},
                      max_position_embeddings=32768, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref_model = Qwen3ForCausalLM(cfg).cuda().float().train()
    enable_tree_attention(ref_model)
    row = pack_row(make_samples(args.group_size, prompt_len, completion_len, budget,
                                cfg.vocab_size, 0))
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_lp, ref = grads_of(ref_model, row, "sdpa")
    del ref_model
    torch.cuda.empty_cache()
    out = {"layers": args.layers, "tokens": row.num_tokens, "compiled": args.compile}
    for label, backend, dense in PATHS:
        torch.manual_seed(0)  # the reference's weights, rounded to bf16
        model = Qwen3ForCausalLM(cfg).cuda().to(torch.bfloat16).train()
        enable_tree_attention(model)
        if args.compile and backend != "sdpa":
            compile_decoder_layers(model)
        saved = level_attention.DENSE
        level_attention.DENSE = dense or saved
        try:
            lp, grads = grads_of(model, row, backend)
        finally:
            level_attention.DENSE = saved
        rel = {n: float((grads[n] - ref[n]).norm() / ref[n].norm()) for n in ref}
        worst = sorted(rel.items(), key=lambda kv: -kv[1])[:3]
        total = (sum(float((grads[n] - ref[n]).norm() ** 2) for n in ref)
                 / sum(float(ref[n].norm() ** 2) for n in ref)) ** 0.5
        out[label] = {"grad_rel_err": round(total, 5),
                      "worst_params": [[n, round(e, 4)] for n, e in worst],
                      "max_logprob_err": round(float((lp - ref_lp).abs().max()), 4),
                      "missing_grads": sorted(set(ref) - set(grads))[:3]}
        print(json.dumps({label: out[label]}), flush=True)
        del model
        torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
