"""Tree packing vs unpacked padded batches: forward+backward time and log-prob agreement.

Each case builds groups of G rollouts sharing a long prompt (G sets the packing ratio), packs
them into one row of `token_budget` unique tokens, and times forward+backward of
  packed:   one tree-packed row through the `grpo_tree` attention backend;
  unpacked: the same samples as one right-padded batch through the model's SDPA backend.
Both read log-probs with the same tiled LM head, so the ratio isolates packing. Two timings:
one row with the GPU drained before and after it (`speedup`), and `--rows` different rows
back to back with one wait at the end, as the trainer runs the micro-batches of an optimizer
step (`pipelined_speedup`: there the host queues row i+1 while the GPU runs row i). One JSON
line per case (`device`, `packing_ratio`, `speedup`, `max_logprob_diff`, on CUDA each path's
peak memory, ...); then one line for the LM-head memory (tiled vs full logits, CUDA only); the
last line is the summary.

    python bench/packing.py                 # CPU: the tiny model
    python bench/packing.py --model qwen3-0.6b   # GPU: a random Qwen3-0.6B-shaped model (bf16)
    python bench/packing.py --model qwen3.5-2b   # GPU: random Qwen3.5-2B text shape (hybrid)
    python bench/packing.py --compile --graphs off,on   # GPU: also the packed step as CUDA
                                                        # graphs over bucketed rows (graph_*)
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch
from grpo_agent.train import (
    flash_impl,
    fused_projections,
    level_attention,
    logprobs,
    row_graphs,
    varlen_attention,
)
from grpo_agent.train.forward import forward_row
from grpo_agent.train.logprobs import naive_token_logprobs, token_logprobs
from grpo_agent.train.packing import pack_row
from grpo_agent.train.regional_compile import compile_decoder_layers
from grpo_agent.train.transfer import to_device
from grpo_agent.train.tree_attention import BACKENDS, choose_backend, enable_tree_attention
from grpo_agent.types import TrainingSample, TrainingSequence
from packing_graphs import graph_case, kernel_profile

SHAPES = {
    # name: (config kwargs, dtype, prompt_len, completion_len, token_budget)
    "tiny": (
        {
            "vocab_size": 2048,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "tie_word_embeddings": False,
        },
        torch.float32,
        192,
        48,
        1536,
    ),
    "qwen3-0.6b": (
        {
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "tie_word_embeddings": True,
        },
        torch.bfloat16,
        1024,
        256,
        8192,
    ),
    "qwen3-1.7b": (
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "tie_word_embeddings": True,
        },
        torch.bfloat16,
        1024,
        256,
        16384,
    ),
    # Qwen3.5-2B's text model (Gated DeltaNet hybrid: 3 linear-attention layers per full one)
    "qwen3.5-2b": (
        {
            "vocab_size": 248320,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 24,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "tie_word_embeddings": True,
        },
        torch.bfloat16,
        1024,
        256,
        8192,
    ),
}
GROUP_SIZES = (1, 2, 4, 8, 16)


def build_model(shape: str, device: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    kwargs, dtype, *_ = SHAPES[shape]
    hybrid = "linear_num_key_heads" in kwargs
    config_cls, model_cls = (
        (Qwen3_5TextConfig, Qwen3_5ForCausalLM) if hybrid else (Qwen3Config, Qwen3ForCausalLM)
    )
    cfg = config_cls(max_position_embeddings=32768, attn_implementation="sdpa", **kwargs)
    torch.manual_seed(0)
    model = model_cls(cfg).to(device=device, dtype=dtype)
    model.train()
    return model


def make_samples(
    group_size: int, prompt_len: int, completion_len: int, budget: int, vocab: int, seed: int = 0
):
    """Whole groups until the packed row would pass the budget; completions vary in length."""
    gen = random.Random(group_size + 1000 * seed)
    samples, used, group = [], 0, 0
    while True:
        prompt = [gen.randrange(vocab) for _ in range(prompt_len)]
        comps = [
            [
                gen.randrange(vocab)
                for _ in range(gen.randint(completion_len // 2, completion_len * 3 // 2))
            ]
            for _ in range(group_size)
        ]
        cost = prompt_len + sum(len(c) + 1 for c in comps)
        if used + cost > budget and samples:
            return samples
        used += cost
        for comp in comps:
            ids = prompt + comp
            mask = [0] * prompt_len + [1] * len(comp)
            lps = [-gen.uniform(0.1, 3.0) if m else 0.0 for m in mask]
            seq = TrainingSequence(token_ids=ids, trained_mask=mask, sampler_logprobs=lps)
            samples.append(
                TrainingSample(
                    seq,
                    advantage=gen.uniform(-1, 1),
                    model_version=0,
                    group_id=group,
                    row_index=group,
                )
            )
        group += 1


def padded_batch(samples):
    """The right-padded batch and the (row, column, target) of every trained token, on CPU.

    Built once outside the timed step, as `pack_row` is for the packed path."""
    longest = max(s.num_tokens for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attn = torch.zeros(len(samples), longest, dtype=torch.long)
    rows, cols, targets = [], [], []
    for i, s in enumerate(samples):
        ids[i, : s.num_tokens] = torch.tensor(s.sequence.token_ids)
        attn[i, : s.num_tokens] = 1
        for t, m in enumerate(s.sequence.trained_mask):
            if m and t > 0:
                rows.append(i), cols.append(t - 1), targets.append(s.sequence.token_ids[t])
    return ids, attn, torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)


def unpacked_logprobs(model, batch, device):
    """Padded batch through the ordinary model; log-probs of trained tokens, in order."""
    ids, attn, rows, cols, targets = to_device(device, *batch)
    hidden = model.get_decoder()(
        input_ids=ids, attention_mask=attn, use_cache=False
    ).last_hidden_state
    weight = model.get_output_embeddings().weight
    return token_logprobs(hidden[rows, cols], weight, targets).logprobs


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(step, device, repeats: int) -> tuple[float, float]:
    """Median seconds per step, and median seconds until `step` returned (kernels queued).

    When the second is close to the first, the host cannot queue kernels faster than the GPU
    runs them: the step is launch-bound and its time follows the CPU, not the GPU."""
    for _ in range(3):  # warm-up (and compilation)
        step()
    times, queued = [], []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        queued.append(time.perf_counter() - start)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(queued)


def run_case(packed_model, plain_model, shape, group_size, device, repeats, budget=None,
             compiled=False, backend="auto", rows=4, baseline=False, graphs=("off",),
             graph_steps=((512, 512),), profile=False):
    _, _, prompt_len, completion_len, default_budget = SHAPES[shape]
    budget = budget or default_budget
    vocab = plain_model.config.vocab_size
    row_samples = [
        make_samples(group_size, prompt_len, completion_len, budget, vocab, seed)
        for seed in range(rows)
    ]
    packed_rows = [pack_row(samples) for samples in row_samples]
    batches = [padded_batch(samples) for samples in row_samples]
    samples, row, batch = row_samples[0], packed_rows[0], batches[0]

    def packed_step(row=row):
        lp = forward_row(packed_model, row, temperature=1.0, backend=backend).token.logprobs
        lp.sum().backward()
        return lp

    def unpacked_step(batch=batch):
        lp = unpacked_logprobs(plain_model, batch, device)
        lp.sum().backward()
        return lp

    packed_s, packed_queued_s = time_fwd_bwd(packed_step, device, repeats)
    unpacked_s, unpacked_queued_s = time_fwd_bwd(unpacked_step, device, repeats)
    # the micro-batches of an optimizer step: different rows, no wait between them
    pipelined_packed_s = time_fwd_bwd(
        lambda: [packed_step(r) for r in packed_rows], device, repeats
    )[0] / rows
    pipelined_unpacked_s = time_fwd_bwd(
        lambda: [unpacked_step(b) for b in batches], device, repeats
    )[0] / rows
    old = {}
    if baseline:  # the previous kernels, same rows, same process
        with previous_kernels():
            old_s = time_fwd_bwd(packed_step, device, repeats)[0]
            old_pipelined_s = time_fwd_bwd(
                lambda: [packed_step(r) for r in packed_rows], device, repeats
            )[0] / rows
        old = {"old_packed_s": round(old_s, 5), "new_over_old": round(packed_s / old_s, 3),
               "old_pipelined_packed_s": round(old_pipelined_s, 5),
               "pipelined_new_over_old": round(pipelined_packed_s / old_pipelined_s, 3)}
    pipelined_ratio = sum(r.unpacked_tokens for r in packed_rows) / sum(
        r.num_tokens for r in packed_rows
    )
    memory = {}
    if device == "cuda":
        memory = {"packed_peak_gib": peak_memory_gib(packed_step),
                  "unpacked_peak_gib": peak_memory_gib(unpacked_step)}
    with torch.no_grad():
        diff = (
            (
                forward_row(packed_model, row, temperature=1.0, backend=backend).token.logprobs
                - unpacked_logprobs(plain_model, batch, device)
            )
            .abs()
            .max()
            .item()
        )
    padded = max(s.num_tokens for s in samples) * len(samples)
    packed_model.zero_grad(set_to_none=True), plain_model.zero_grad(set_to_none=True)
    graphed = {}
    if "on" in graphs:
        eager = {"packed_s": packed_s, "unpacked_s": unpacked_s, "pipelined_ratio": pipelined_ratio,
                 "pipelined_packed_s": pipelined_packed_s,
                 "pipelined_unpacked_s": pipelined_unpacked_s,
                 "packed_peak_gib": memory.get("packed_peak_gib")}
        graphed = graph_case(packed_model, packed_step, packed_rows, eager,
                             lambda step: time_fwd_bwd(step, device, repeats), peak_memory_gib,
                             graph_steps, profile)
        if profile:
            graphed |= {"profile_eager_packed": kernel_profile(packed_step),
                        "profile_unpacked": kernel_profile(unpacked_step)}
        torch.cuda.empty_cache()
    return {
        "case": f"{shape}/G={group_size}",
        "compiled": compiled,
        "fused_projections": compiled and fused_projections.fused_groups > 0,
        "backend": (
            choose_backend(torch.device(device), SHAPES[shape][1], row.num_tokens,
                           SHAPES[shape][0].get("head_dim"))
            if backend == "auto" else backend
        ),
        "device": device,
        "token_budget": budget,
        "dtype": str(SHAPES[shape][1]),
        "samples": len(samples),
        "packed_tokens": row.num_tokens,
        "unpacked_tokens": row.unpacked_tokens,
        "padded_tokens": padded,
        "packing_ratio": round(row.unpacked_tokens / row.num_tokens, 3),
        "packed_s": round(packed_s, 5),
        "unpacked_s": round(unpacked_s, 5),
        "packed_queued_s": round(packed_queued_s, 5),
        "unpacked_queued_s": round(unpacked_queued_s, 5),
        "speedup": round(unpacked_s / packed_s, 3),
        "speedup_over_ratio": round(
            unpacked_s / packed_s / (row.unpacked_tokens / row.num_tokens), 3
        ),
        "rows": rows,
        "pipelined_packing_ratio": round(pipelined_ratio, 3),
        "pipelined_packed_s": round(pipelined_packed_s, 5),
        "pipelined_unpacked_s": round(pipelined_unpacked_s, 5),
        "pipelined_speedup": round(pipelined_unpacked_s / pipelined_packed_s, 3),
        "pipelined_speedup_over_ratio": round(
            pipelined_unpacked_s / pipelined_packed_s / pipelined_ratio, 3
        ),
        "max_logprob_diff": diff,
        **({"gdn_kernel": _gdn_kernel(packed_model, device)}
           if getattr(packed_model, "_grpo_linear_layers", 0) else {}),
        "lm_head": logprobs.LM_HEAD,
        **graphed,
        **old,
        **memory,
    }


class previous_kernels:
    """Before issue 23: the LM head's torch tiles, float32 sums in the gather's backward, every
    level part on the flash varlen kernel (no padded cuDNN parts)."""

    def __enter__(self):
        self.saved = logprobs.LM_HEAD, varlen_attention.GATHER_GRAD_DTYPE, level_attention.DENSE
        logprobs.LM_HEAD, varlen_attention.GATHER_GRAD_DTYPE = "torch", torch.float32
        level_attention.DENSE = "off"

    def __exit__(self, *exc):
        logprobs.LM_HEAD, varlen_attention.GATHER_GRAD_DTYPE, level_attention.DENSE = self.saved


def _gdn_kernel(model, device) -> str:
    """Which Gated DeltaNet kernel the packed path ran (hybrid models)."""
    from grpo_agent.train import delta_rule

    fla = device == "cuda" and delta_rule.fla_chunk_rule() is not None
    return "flash-linear-attention chunk_gated_delta_rule" if fla else "torch"


def peak_memory_gib(step) -> float:
    """Peak CUDA memory of one step above what was allocated before it (weights, grads)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def lm_head_memory(device: str, tokens: int = 16384, vocab: int = 151936, hidden: int = 1024):
    """Peak extra CUDA memory of fwd+bwd through the LM head: tiled vs full logits."""
    weight = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    out = {"case": "lm_head_memory", "device": device, "tokens": tokens, "vocab": vocab}
    for name, fn in (
        ("tiled", lambda: token_logprobs(h, weight, targets).logprobs),
        ("full_logits", lambda: naive_token_logprobs(h, weight, targets)),
    ):
        out[f"{name}_peak_gib"] = peak_memory_gib(lambda fn=fn: fn().sum().backward())
        weight.grad = h.grad = None
    out["memory_ratio"] = round(out["full_logits_peak_gib"] / out["tiled_peak_gib"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=sorted(SHAPES),
        default=None,
        help="model shape (default: qwen3-0.6b on CUDA, tiny on CPU)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rows", type=int, default=4,
        help="rows per pipelined measurement (the micro-batches of one optimizer step)",
    )
    parser.add_argument(
        "--token-budget", type=int, default=None, help="override the shape's budget"
    )
    parser.add_argument(
        "--group-sizes",
        type=lambda text: [int(g) for g in text.split(",")],
        default=list(GROUP_SIZES),
        help="comma-separated G values (rollouts sharing a prompt) to run",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decoder layers of both models (what torch_compile=True does)",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode for --compile (the trainer's torch_compile_mode), e.g. "
        "reduce-overhead (CUDA graphs)",
    )
    parser.add_argument(
        "--no-fused-projections",
        action="store_true",
        help="with --compile: keep q/k/v and gate/up as separate matmuls",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", *BACKENDS],
        default="auto",
        help="tree attention backend of the packed path (auto: what the trainer picks)",
    )
    parser.add_argument(
        "--lm-head", choices=logprobs.LM_HEAD_CHOICES, default="auto",
        help="LM-head kernels of both paths (torch: the tiles; auto: Triton where it runs)",
    )
    parser.add_argument(
        "--baseline", action="store_true",
        help="also time the packed path with the previous kernels (torch LM head, float32 "
        "gather sums) in the same process: old_packed_s, new_over_old",
    )
    parser.add_argument(
        "--graphs", type=lambda text: text.split(","), default=["off"],
        help="off,on: also time the packed step through CUDA graphs over bucketed row shapes "
        "(row_graphs; CUDA) in the same process, with its exactness against the eager step",
    )
    parser.add_argument(
        "--graph-steps", default=f"{row_graphs.STEPS['tokens']}:{row_graphs.STEPS['trained']}",
        type=lambda text: [(*map(int, v.split(":")[:2]), *v.split(":")[2:]) for v in text.split(",")],
        help="with --graphs on: bucket sizes to time one after another, as tokens:trained "
        "steps (a row is padded to a multiple of each), e.g. 512:512,64:64; further fields: "
        "'levels' or 'masked' captures that tree path (default varlen), 'arrival' captures buckets "
        "in the rows' order instead of largest first (e.g. 64:64:levels:arrival)",
    )
    parser.add_argument(
        "--profile-kernels", action="store_true",
        help="with --graphs on: GPU kernel tables (by kind) of one eager packed row, one "
        "replayed row per bucket size and the unpacked batch",
    )
    args = parser.parse_args()
    if set(args.graphs) - {"off", "on"}:
        parser.error(f"--graphs takes off and/or on, got {','.join(args.graphs)}")
    logprobs.LM_HEAD = args.lm_head
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = args.model or ("qwen3-0.6b" if device == "cuda" else "tiny")
    if device == "cpu":
        torch.set_num_threads(1)  # shared 2-core box; both paths get the same
    # as the trainer does: FlashAttention 4 under `auto` only for rows that keep the GPU busy
    # (GRPO_AGENT_FLASH_IMPL=FA4 for the CUDA-graph rows, whose replays have no host work)
    flash_impl.expect_rows(args.token_budget or SHAPES[shape][4])
    plain = build_model(shape, device)
    packed = copy.deepcopy(plain)
    enable_tree_attention(packed)
    if args.compile:
        fused_projections.ENABLED = not args.no_fused_projections
        compile_decoder_layers(packed, mode=args.compile_mode)
        compile_decoder_layers(plain, mode=args.compile_mode)
    results = []
    for group_size in args.group_sizes:
        results.append(
            run_case(packed, plain, shape, group_size, device, args.repeats, args.token_budget,
                     args.compile, args.backend, args.rows, args.baseline,
                     args.graphs if device == "cuda" else ("off",), args.graph_steps,
                     args.profile_kernels)
        )
        print(json.dumps(results[-1]), flush=True)
    if device == "cuda":
        del plain, packed
        torch.cuda.empty_cache()
        print(json.dumps(lm_head_memory(device)), flush=True)
    shared = [r for r in results if r["packing_ratio"] > 1.5] or results
    print(
        json.dumps(
            {
                "summary": "packing",
                "device": device,
                "model": shape,
                "compiled": args.compile,
                "flash_impl": flash_impl.active(),
                "mean_speedup_over_ratio": round(
                    statistics.mean(r["speedup_over_ratio"] for r in shared), 3
                ),
                "mean_pipelined_speedup_over_ratio": round(
                    statistics.mean(r["pipelined_speedup_over_ratio"] for r in shared), 3
                ),
                "max_logprob_diff": max(r["max_logprob_diff"] for r in results),
                "cases": [(r["packing_ratio"], r["speedup"]) for r in results],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
