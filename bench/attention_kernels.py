"""Attention kernels torch offers on this GPU, forward+backward, bf16: a lead for tree rows.

Dense causal SDPA at 16k tokens per call through each SDPA backend (flash = FA2, cuDNN,
memory-efficient), and the varlen form the `levels` backend uses for a row's self part
(each segment causal on itself, q and k lengths equal, so causal alignment does not matter):
torch's flash varlen vs cuDNN's ragged kernel (`aten._cudnn_attention_forward/_backward`,
which torch 2.11's own `varlen_attn` leaves switched off; no GQA there, so K/V are expanded
to the query heads for every line of the comparison). Each line: median ms of 20 (CUDA
events), TFLOP/s of the causal pairs (x3.5 for forward+backward), and for cuDNN varlen the
largest difference to flash's output. A variant that torch rejects prints its error.

Then tree rows through `level_attention` (bench/packing.py's rows: prompts of 1024,
completions of 128-384), every part on flash (the old path) against padded parts on cuDNN (all
parts, or the depth parts alone).

    PYTHONPATH=core python bench/attention_kernels.py
    PYTHONPATH=core python bench/attention_kernels.py --merges   # level merge, old vs new
"""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F
from grpo_agent.train.packing import pack_row
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, DIM = 16, 128


def timed_ms(fn, repeats=20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def causal_flops(lengths, passes: float) -> float:
    """FLOPs of causal attention over segments: passes 1 forward, 3.5 forward+backward."""
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return passes * 4 * HEADS * DIM * pairs


def report(name, lengths, fn, passes=3.5, **extra):
    try:
        ms = timed_ms(fn)
        out = {"case": name, "ms": round(ms, 3),
               "tflops": round(causal_flops(lengths, passes) / ms / 1e9, 1), **extra}
    except Exception as exc:  # noqa: BLE001 -- a backend torch rejects: say so, go on
        out = {"case": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(out), flush=True)


def dense(batch: int, length: int):
    q, k, v = (torch.randn(batch, HEADS, length, DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        def step(backend=backend):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        report(f"dense {batch}x{length} {backend.name}", [length] * batch, step)


def varlen(lengths):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)
    longest = max(lengths)
    q, k, v = (torch.randn(total, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    grad = torch.randn_like(q)
    scale = DIM ** -0.5

    def flash_fwd():
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale)

    flash_out = flash_fwd()

    def flash_step():
        out, lse, seed, offset, _ = flash_fwd()
        torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, seed, offset,
            scale=scale)

    name = f"varlen {len(lengths)} segments, {total} tokens"
    report(f"{name} flash", lengths, flash_step)

    def cudnn_fwd():
        return torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, longest, longest, True, 0.0, True, False, scale=scale)

    try:
        res = cudnn_fwd()
        diff = float((res[0].float() - flash_out[0].float()).abs().max())
    except Exception as exc:  # noqa: BLE001
        print(json.dumps({"case": f"{name} cudnn", "error": f"{type(exc).__name__}: {exc}"[:400]}),
              flush=True)
        return
    report(f"{name} cudnn forward only", lengths, cudnn_fwd, passes=1, max_diff_to_flash=diff)
    report(f"{name} flash forward only", lengths, flash_fwd, passes=1)

    def cudnn_step():
        out, lse, *_, seed, offset, _ = cudnn_fwd()
        torch.ops.aten._cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, torch.empty(0, device="cuda"), cu, cu,
            longest, longest, 0.0, True, scale=scale)

    report(f"{name} cudnn", lengths, cudnn_step, max_diff_to_flash=diff)


def levels(group_size: int, budget: int, prompt_len=1024, completion_len=256, repeats=20,
           profile=False):
    """A tree row's attention (16 q / 8 kv heads of 128) through `level_attention`: every part
    on torch's flash varlen kernel (the old path) vs padded parts on cuDNN, alternating."""
    from grpo_agent.train import cudnn_attention
    from grpo_agent.train.level_attention import LevelPlan, level_tree_attention
    from grpo_agent.train.tree_attention import dense_tree_mask

    cudnn_attention.usable(torch.device("cuda"), torch.bfloat16)  # the probe, once
    row, q, k, v, grad = _row_and_inputs(group_size, prompt_len, completion_len, budget)
    n = row.num_tokens
    mask = dense_tree_mask(row.segment_ids.cuda(), row.segment_ancestors.cuda())
    pairs = float(mask.sum())
    plans = {dense: LevelPlan.build(row, "cuda", "flash", dense=dense)
             for dense in ("off", "cudnn", "cudnn-depth")}
    outs = {}
    for dense, plan in plans.items():
        out = level_tree_attention(q, k, v, plan, DIM ** -0.5)
        out.backward(grad)
        outs[dense] = [out.float(), *(t.grad.float() for t in (q, k, v))]
        for t in (q, k, v):
            t.grad = None
    times = {dense: [] for dense in plans}
    for _ in range(2):  # alternate: drift between the two shows as spread
        for dense, plan in plans.items():
            times[dense].append(timed_ms(
                lambda plan=plan: level_tree_attention(q, k, v, plan, DIM ** -0.5).backward(grad),
                repeats))
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        for dense, plan in plans.items():
            with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    level_tree_attention(q, k, v, plan, DIM ** -0.5).backward(grad)
                torch.cuda.synchronize()
            print(f"profile {dense}, 5 steps, G={group_size}", flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
    diffs = {dense: [round(float((a - b).norm() / b.norm()), 5) for a, b in zip(got, outs["off"])]
             for dense, got in outs.items() if dense != "off"}
    cudnn = plans["cudnn"]
    print(json.dumps({
        "case": f"levels G={group_size} {n} tokens", "pairs": pairs,
        "flash_ms": [round(t, 3) for t in times["off"]],
        "cudnn_ms": [round(t, 3) for t in times["cudnn"]],
        "cudnn_depth_ms": [round(t, 3) for t in times["cudnn-depth"]],
        "cudnn_over_flash": round(statistics.median(times["cudnn"])
                                  / statistics.median(times["off"]), 3),
        "cudnn_depth_over_flash": round(statistics.median(times["cudnn-depth"])
                                        / statistics.median(times["off"]), 3),
        "flash_tflops": round(3.5 * 4 * HEADS * DIM * pairs / min(times["off"]) / 1e9, 1),
        "cudnn_tflops": round(3.5 * 4 * HEADS * DIM * pairs / min(times["cudnn"]) / 1e9, 1),
        "self_batches": [(p.batch, p.len_q) for p in cudnn.self_dense],
        "depth_dense": [None if p is None else (p.batch, p.len_q, p.len_k)
                        for p in cudnn.depth_dense],
        "rel_diff_out_dq_dk_dv_to_flash": diffs, "probe": cudnn_attention.PROBE_NOTES,
    }), flush=True)


def merges(group_size: int, budget: int, prompt_len=1024, completion_len=256, repeats=20):
    """One tree row's level attention, eager: parts summed in whole-row float32 (the old path)
    vs on their own rows in the compute dtype (`level_merge`), with the depth parts on flash
    and on cuDNN; alternating, two passes; relative differences to the old path."""
    import dataclasses

    from grpo_agent.train import cudnn_attention
    from grpo_agent.train.level_attention import LevelPlan, level_tree_attention

    cudnn_attention.usable(torch.device("cuda"), torch.bfloat16)
    row, q, k, v, grad = _row_and_inputs(group_size, prompt_len, completion_len, budget)
    n = row.num_tokens
    for dense in ("off", "cudnn-depth"):
        base = LevelPlan.build(row, "cuda", "flash", dense=dense)
        plans = {m: dataclasses.replace(base, merge=m) for m in ("float32", "rows")}
        outs, times = {}, {m: [] for m in plans}
        for merge, plan in plans.items():
            for t in (q, k, v):  # the timing loops below accumulate into them
                t.grad = None
            out = level_tree_attention(q, k, v, plan, DIM ** -0.5)
            out.backward(grad)
            outs[merge] = [out.detach().float(), *(t.grad.float() for t in (q, k, v))]
        for _ in range(2):
            for merge, plan in plans.items():
                times[merge].append(timed_ms(
                    lambda plan=plan: level_tree_attention(q, k, v, plan, DIM ** -0.5
                                                           ).backward(grad), repeats))
        print(json.dumps({
            "case": f"merge G={group_size} {n} tokens, depth parts {dense}",
            "float32_ms": [round(t, 3) for t in times["float32"]],
            "rows_ms": [round(t, 3) for t in times["rows"]],
            "rows_over_float32": round(statistics.median(times["rows"])
                                       / statistics.median(times["float32"]), 3),
            "rel_diff_out_dq_dk_dv": [round(float((a - b).norm() / b.norm()), 6)
                                      for a, b in zip(outs["rows"], outs["float32"])],
        }), flush=True)


def main() -> None:
    import sys

    if "--merges" in sys.argv:  # level merge, old vs new
        for group_size in (8, 56):
            merges(group_size, 16384)
        merges(8, 8192)
        return

    if "--levels-only" in sys.argv:  # the tree rows alone, the first with a kernel profile
        levels(8, 16384, profile=True)
        levels(56, 16384)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention_kernels.py measures a GPU: run it on one.")
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name()}), flush=True)
    dense(4, 4096)
    dense(16, 1024)
    varlen([1024] + [256] * 8 + [1024] + [256] * 8 + [1024] + [256] * 8 + [1024] + [256] * 8)
    varlen([4096] * 4)
    for group_size, budget in ((8, 16384), (56, 16384), (8, 8192), (1, 16384)):
        levels(group_size, budget)



def _row_and_inputs(group_size, prompt_len, completion_len, budget):
    """A packed bench row and random bf16 q, k, v (GQA 2:1) and output gradient for it."""
    from packing import make_samples

    row = pack_row(make_samples(group_size, prompt_len, completion_len, budget, 1000))
    n = row.num_tokens
    q = torch.randn(1, HEADS, n, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, HEADS // 2, n, DIM, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn(1, n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    return row, q, k, v, grad

if __name__ == "__main__":
    main()
