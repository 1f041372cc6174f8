"""The varlen path's gather backward alone: summing the gathered K/V gradients of a tree row in
float32 vs in bf16 (the compute dtype), time and error against a float64 sum.

A row of `--groups` prompts, each shared by G completions (so a prompt token's gradient is the
sum of G+1 rows); gradients [gathered rows, heads, dim] in bf16 as the flash backward gives
them. One JSON line per G: median seconds of each sum (CUDA events) and the relative error
||sum - ref|| / ||ref|| and largest relative error per element of the result in bf16.

    python bench/gather_grad.py
"""

from __future__ import annotations

import json
import statistics

import torch
from grpo_agent.train import varlen_attention


def tree_index(groups: int, group_size: int, prompt: int, completion: int) -> tuple[int, list]:
    """Row length and every segment's path (row indices), depth-first like `pack_row`."""
    index, rows = [], 0
    for _ in range(groups):
        prompt_rows = list(range(rows, rows + prompt))
        index += prompt_rows
        rows += prompt
        for _ in range(group_size):
            index += prompt_rows + list(range(rows, rows + completion))
            rows += completion
    return rows, index


def timed(fn, repeats=20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/gather_grad.py measures a GPU: run it on one.")
    for group_size, groups in ((2, 5), (8, 3), (16, 2), (56, 1)):
        rows, index = tree_index(groups, group_size, 1024, 256)
        index = torch.tensor(index, device="cuda")
        x = torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(index.numel(), 8, 128, device="cuda", dtype=torch.bfloat16)
        ref = torch.zeros(rows, 8, 128, device="cuda", dtype=torch.float64)
        ref.index_add_(0, index, grad.double())
        out = {"case": "gather_grad", "group_size": group_size, "rows": rows,
               "gathered": index.numel()}
        for name, dtype in (("fp32", torch.float32), ("compute", None)):
            varlen_attention.GATHER_GRAD_DTYPE = dtype

            def backward(x=x, index=index, grad=grad):
                x.grad = None
                varlen_attention._GatherRows.apply(x, index).backward(grad)

            out[f"{name}_s"] = round(timed(backward), 6)
            err = x.grad.double() - ref
            out[f"{name}_rel_err"] = float(err.norm() / ref.norm())
            out[f"{name}_max_rel_err"] = float((err.abs() / ref.abs().clamp(min=1e-2)).max())
        varlen_attention.GATHER_GRAD_DTYPE = torch.float32
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
