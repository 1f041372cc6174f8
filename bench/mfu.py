"""MFU of the packed training step on a GPU, with today's and the previous kernels side by side.

A random Qwen3-shaped model (bf16, decoder layers compiled as `torch_compile=True` does) runs
`--rows` different tree-packed rows back to back (forward, target log-probs, backward), as the
trainer runs the micro-batches of a step; CUDA events, median of `--repeats`. FLOPs are the
trainer's own count (`perf.packed_training_flops`: projections and MLP at every packed token,
the tree's visible query-key pairs, the LM head at trained positions), over the peak of
`perf.PEAK_FLOPS`. Each variant is a tree-attention backend x LM head x gather-gradient dtype
x level parts (dense, merge), so "old" (torch LM head, float32 gather sums, float32 merge) and
"new" lines come from one process. One JSON line per variant, with peak memory of one row and
the largest log-prob difference to the first variant; the summary line last.

    python bench/mfu.py                                   # qwen3-1.7b, 16k-token rows, G=8
    python bench/mfu.py --model qwen3-0.6b --token-budget 8192 --group-sizes 8
    python bench/mfu.py --group-sizes 56 --backends varlen,levels   # one prompt per row
    python bench/mfu.py --backends masked,levels --flash-impls FA4  # FA4 with the tree mask
    python bench/mfu.py --merges float32,rows --profile out/   # level merge, old vs new
    python bench/mfu.py --backends levels --fuse off,on        # level merge unfused vs fused
    python bench/mfu.py --swiglu off,on --passes 2   # inductor's SwiGLU vs the op, alternating
    python bench/mfu.py --compile-modes default,max-autotune-no-cudagraphs --passes 2
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from grpo_agent.train import (
    compiled_or_eager,
    flash_impl,
    fused_lm_head,
    level_attention,
    level_merge,
    logprobs,
    perf,
    swiglu,
    varlen_attention,
)
from grpo_agent.train.forward import attention_head_dim, forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.regional_compile import compile_decoder_layers, decoder_layers
from grpo_agent.train.tree_attention import choose_backend, enable_tree_attention
from packing import SHAPES, build_model, make_samples, peak_memory_gib

GATHER_DTYPES = {"fp32": torch.float32, "compute": None}
SWIGLU_DEVICES = {"on": ("cuda",), "off": ()}


def recompile_layers(model, mode: str) -> None:
    """The decoder layers compiled (again) in `mode`: "default" is torch.compile's own."""
    torch._dynamo.reset()
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None
    compile_decoder_layers(model, mode=None if mode == "default" else mode)


def steps_seconds(step, repeats: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def profile_step(step, folder: str, name: str) -> None:
    """One step under torch.profiler: GPU time by kernel, the top 12 printed, all to a file;
    GPU time by operator and input shapes to a second file (which matmuls, which copies)."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type.name == "CPU" and e.self_device_time_total > 0]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, f"ops-{name}.txt").write_text("".join(
        f"{e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:60]}  "
        f"{str(e.input_shapes)[:140]}\n" for e in ops))
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in kernels)
    lines = [f"{e.device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:110]}"
             for e in kernels]
    Path(folder, f"profile-{name}.txt").write_text(
        f"{name}: {total / 1e3:.2f} ms GPU, {sum(e.count for e in kernels)} kernels\n"
        + "\n".join(lines) + "\n")
    print(f"profile {name}: {total / 1e3:.2f} ms GPU, {sum(e.count for e in kernels)} kernels",
          flush=True)
    print("\n".join(lines[:12]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--group-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[8])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="auto",
                        help="comma-separated tree attention backends (auto: the trainer's)")
    parser.add_argument("--lm-heads", default="torch,auto",
                        help="comma-separated logprobs.LM_HEAD values (torch: the old tiles)")
    parser.add_argument("--gather-dtypes", default="fp32",
                        help="comma-separated: fp32 (old) and/or compute (the gather's "
                        "backward sums in the gradient's dtype; varlen only)")
    parser.add_argument("--dense", default="off,auto",
                        help="comma-separated level_attention.DENSE values: off (the varlen "
                        "flash kernel for every level part, the old path), auto (padded parts "
                        "on cuDNN where its probe passes); levels only")
    parser.add_argument("--merges", default="rows",
                        help="comma-separated level_merge.MERGE values: float32 (the whole-row "
                        "float32 merge and gradient sums, the old path), rows (each part's "
                        "rows, in the compute dtype); levels only")
    parser.add_argument("--fuse", default="on",
                        help="comma-separated on/off: compiled_or_eager.COMPILE_ON_CUDA, the "
                        "small compiled functions (the level merge's rows; the LM head's tiles "
                        "under --lm-heads torch); off is the unfused previous path")
    parser.add_argument("--flash-impls", default="auto",
                        help="comma-separated kernels behind torch's flash ops: default "
                        "(torch's own, the old path), FA4 (FlashAttention 4), auto (the "
                        "trainer's choice: flash_impl.torch_flash_impl)")
    parser.add_argument("--swiglu", default="on",
                        help="comma-separated on/off: whether the compiled layers' MLP runs "
                        "the swiglu op (off: inductor's own kernels, the old path); a switch "
                        "recompiles the layers")
    parser.add_argument("--lm-head-configs", type=json.loads, default=[{}],
                        help="JSON list of fused LM head kernel configs (updates of "
                        "fused_lm_head.CONFIG, e.g. '[{}, {\"TMA\": true}]'), one variant each")
    parser.add_argument("--profile", metavar="DIR",
                        help="profile one step of each variant's first pass: top kernels "
                        "printed, the full table written to DIR")
    parser.add_argument("--passes", type=int, default=1,
                        help="time every variant this many times, alternating")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compile-modes", default="default",
                        help="torch.compile modes of the decoder layers (the trainer's "
                        "torch_compile_mode), alternated like the other variants, e.g. "
                        "default,max-autotune-no-cudagraphs (a switch compiles them again)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/mfu.py measures a GPU: run it on one.")
    # every variant (and the no-grad log-prob forward) is its own graph of the compiled layer
    torch._dynamo.config.recompile_limit = 64
    model = build_model(args.model, "cuda")
    enable_tree_attention(model)
    modes = ["eager"] if args.no_compile else args.compile_modes.split(",")
    compiled_mode = None
    _, dtype, prompt_len, completion_len, _ = SHAPES[args.model]
    peak = perf.peak_flops_per_s(torch.cuda.get_device_name(), "bf16")
    results = []
    impls = [flash_impl.torch_flash_impl() if i == "auto" else i
             for i in args.flash_impls.split(",")]
    default_head = dict(fused_lm_head.CONFIG)
    for group_size in args.group_sizes:
        rows = [pack_row(make_samples(group_size, prompt_len, completion_len, args.token_budget,
                                      model.config.vocab_size, seed))
                for seed in range(args.rows)]
        flops = perf.packed_training_flops(model.config, rows)
        reference = None
        variants = [(b, g, h, d, m, f, i, c, sw, cm) for b in args.backends.split(",")
                    for g in args.gather_dtypes.split(",") for h in args.lm_heads.split(",")
                    for d in args.dense.split(",") for m in args.merges.split(",")
                    for f in args.fuse.split(",") for i in impls
                    for c in range(len(args.lm_head_configs))
                    for sw in args.swiglu.split(",") for cm in modes]
        profiled = set()
        for backend, gather, lm_head, dense, merge, fuse, impl, head, sw, mode in (
                variants * args.passes):
            if swiglu.REWRITE_DEVICES != SWIGLU_DEVICES[sw]:
                swiglu.REWRITE_DEVICES = SWIGLU_DEVICES[sw]
                torch._dynamo.reset()  # the layers compile again, with or without the op
            if mode != "eager" and mode != compiled_mode:
                recompile_layers(model, mode)
                compiled_mode = mode
            flash_impl.use(impl)
            fused_lm_head.CONFIG = {**default_head, **args.lm_head_configs[head]}
            logprobs.LM_HEAD, level_attention.DENSE = lm_head, dense
            level_merge.MERGE, compiled_or_eager.COMPILE_ON_CUDA = merge, fuse == "on"
            varlen_attention.GATHER_GRAD_DTYPE = GATHER_DTYPES[gather]

            def row_step(row, backend=backend):
                lp = forward_row(model, row, temperature=1.0, backend=backend)
                lp.token.logprobs.sum().backward()
                return lp.token.logprobs

            seconds = steps_seconds(
                lambda rows=rows: [row_step(r) for r in rows], args.repeats)
            memory = peak_memory_gib(lambda rows=rows: row_step(rows[0]))
            name = (f"G{group_size}-{backend}-{lm_head}-{gather}-{dense}-{merge}-fuse-{fuse}"
                    f"-{impl}-head{head}-swiglu-{sw}-{mode}")
            if args.profile and name not in profiled:
                profiled.add(name)
                profile_step(lambda rows=rows: [row_step(r) for r in rows], args.profile, name)
            with torch.no_grad():
                lp = forward_row(model, rows[0], temperature=1.0,
                                 backend=backend).token.logprobs.float()
            reference = lp if reference is None else reference
            model.zero_grad(set_to_none=True)
            chosen = (choose_backend(torch.device("cuda"), dtype, rows[0].num_tokens,
                                      attention_head_dim(model.config))
                      if backend == "auto" else backend)
            results.append({
                "case": f"{args.model}/G={group_size}", "backend": chosen,
                "lm_head": lm_head, "gather_grad": gather,
                "dense": dense if chosen == "levels" else "-",
                "merge": merge if chosen == "levels" else "-", "fuse": fuse, "flash_impl": impl,
                "lm_head_config": args.lm_head_configs[head], "swiglu": sw,
                "compiled": mode,
                "tokens_per_row": statistics.mean(r.num_tokens for r in rows),
                "packing_ratio": round(sum(r.unpacked_tokens for r in rows)
                                       / sum(r.num_tokens for r in rows), 3),
                "s_per_row": round(seconds / args.rows, 5),
                "mfu": round(perf.mfu(flops, seconds, peak), 4),
                "tflops": round(flops / seconds / 1e12, 1),
                "peak_gib": memory,
                "max_logprob_diff_to_first": round(float((lp - reference).abs().max()),
                                                   5),
            })
            print(json.dumps(results[-1]), flush=True)
    logprobs.LM_HEAD, level_attention.DENSE, level_merge.MERGE = "auto", "auto", "rows"
    fused_lm_head.CONFIG = default_head
    compiled_or_eager.COMPILE_ON_CUDA = True
    best = max(results, key=lambda r: r["mfu"])
    print(json.dumps({"summary": "mfu", "device": torch.cuda.get_device_name(),
                      "best": {k: best[k] for k in ("case", "backend", "lm_head", "gather_grad",
                                                    "dense", "merge", "fuse", "flash_impl",
                                                    "lm_head_config", "mfu")},
                      "mfu": [(r["case"], r["backend"], r["lm_head"], r["gather_grad"],
                               r["dense"], r["merge"], r["fuse"], r["flash_impl"],
                               r["lm_head_config"], r["mfu"], r["peak_gib"])
                              for r in results]}),
          flush=True)


if __name__ == "__main__":
    main()
