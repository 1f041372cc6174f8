"""Varlen attention kernels against torch's flash kernel on tree rows: cuDNN, FlashAttention 4.

The varlen tree path (`train/varlen_attention.py`) runs one varlen call per layer: each
segment's queries against its gathered path, causal aligned bottom-right. torch 2.11's own
cuDNN ragged entry point rebuilt its graph on every call (73 ms a forward: docs/performance.md);
the cuDNN frontend package (`pip install nvidia-cudnn-frontend`, 11.6 MB, no download at run
time) builds each graph once per (segments, longest query, longest path) and caches it. This
bench times both kernels on the exact calls of bench/packing.py's rows (bf16, 16 q / 8 kv heads
of 128, forward+backward), checks cuDNN's output and gradients against flash's, and measures a
graph build and the bucketing the trainer would need (longest lengths rounded up, empty
segments appended) so that rows of different shapes share graphs. FlashAttention 4
(`pip install flash-attn-4`: CuTe DSL kernels for Hopper and Blackwell, compiled at the first
call of each shape class) is timed on the same calls.

    PYTHONPATH=core:bench python bench/varlen_kernels.py --kernels cudnn,fa4
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from attention_kernels import timed_ms
from grpo_agent.train.packing import pack_row
from grpo_agent.train.varlen_attention import VarlenPlan, torch_flash_varlen
from packing import make_samples

HEADS, KV_HEADS, DIM = 16, 8, 128


def visible_pairs(cu_q: torch.Tensor, cu_k: torch.Tensor) -> int:
    """Query-key pairs of causal bottom-right attention: query i of a q-long segment against a
    k-long path sees k - q + i + 1 keys."""
    q_lens, k_lens = (torch.diff(c).tolist() for c in (cu_q, cu_k))
    return sum(q * (k - q) + q * (q + 1) // 2 for q, k in zip(q_lens, k_lens))


def cudnn_call(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    out, _ = torch.ops.cudnn.sdpa_fwd(
        q, k, v, scale, is_causal=True, causal_bottom_right=True, cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k, return_lse=True)
    return out


def flash_call(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return torch_flash_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                              max_seqlen_k=max_k, softmax_scale=scale, causal=True)


def fa4_call(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


CALLS = {"cudnn": cudnn_call, "fa4": fa4_call}


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def row_case(kernels: list[str], group_size: int, budget: int, prompt_len=1024,
             completion_len=256) -> None:
    row = pack_row(make_samples(group_size, prompt_len, completion_len, budget, 1000))
    plan = VarlenPlan.build(row, "cuda", torch_flash_varlen)
    n, paths = row.num_tokens, int(plan.cu_k[-1])
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_()

    q, k, v = leaf(n, HEADS, DIM), leaf(paths, KV_HEADS, DIM), leaf(paths, KV_HEADS, DIM)
    grad = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = DIM ** -0.5
    args = (plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale)

    def outputs(call, *call_args):
        for t in (q, k, v):
            t.grad = None
        out = call(q, k, v, *call_args)
        out.backward(grad)
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]

    def step(call, call_args):
        def run():
            out = call(q, k, v, *call_args)
            out.backward(grad)
        return run

    def forward(call, call_args):
        def run():
            with torch.no_grad():
                call(q, k, v, *call_args)
        return run

    # Bucketed: longest lengths rounded up to 256, segments padded to a multiple of 16 with
    # empty ones (cu_seqlens repeated): rows of other shapes could then reuse a built kernel.
    segments = plan.cu_q.numel() - 1
    pad = round_up(segments, 16) - segments
    cu_q_b = torch.cat([plan.cu_q, plan.cu_q[-1:].expand(pad)])
    cu_k_b = torch.cat([plan.cu_k, plan.cu_k[-1:].expand(pad)])
    bucket_args = (cu_q_b, cu_k_b, round_up(plan.max_q, 256), round_up(plan.max_k, 256), scale)

    pairs = visible_pairs(plan.cu_q, plan.cu_k)
    flops_fb = 3.5 * 4 * HEADS * DIM * pairs
    flash = outputs(flash_call, *args)
    result = {"group_size": group_size, "tokens": n, "gathered": paths, "segments": segments,
              "max_q": plan.max_q, "max_k": plan.max_k,
              # flash's own magnitudes: the diffs below are bf16 rounding at this scale
              "max_abs_flash_out_dq_dk_dv": [round(float(a.abs().max()), 2) for a in flash]}

    def timing(call, call_args):
        try:
            ms = timed_ms(step(call, call_args))
            fwd = timed_ms(forward(call, call_args))
        except Exception as exc:  # noqa: BLE001 -- report and go on
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        return {"fwd_bwd_ms": round(ms, 3), "fwd_ms": round(fwd, 3),
                "tflops_fwd_bwd": round(flops_fb / ms / 1e9, 1),
                "tflops_fwd": round(4 * HEADS * DIM * pairs / fwd / 1e9, 1)}

    result["flash"] = timing(flash_call, args)
    for name in kernels:
        call = CALLS[name]
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            got = outputs(call, *args)
        except Exception as exc:  # noqa: BLE001 -- a kernel that cannot run this row: say why
            result[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        torch.cuda.synchronize()
        entry = {"first_call_ms": round((time.perf_counter() - start) * 1e3, 1),
                 "max_abs_diff_out_dq_dk_dv": [round(float((a - b).abs().max()), 4)
                                               for a, b in zip(flash, got)]}
        try:
            bucketed = outputs(call, *bucket_args)
            entry["bucketed_vs_exact_diff"] = max(float((a - b).abs().max())
                                                  for a, b in zip(got, bucketed))
        except Exception as exc:  # noqa: BLE001
            entry["bucketed_vs_exact_diff"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        entry["exact"] = timing(call, args)
        entry["bucketed"] = timing(call, bucket_args)
        if isinstance(entry["exact"], dict) and isinstance(result["flash"], dict):
            entry["over_flash_time"] = round(
                entry["exact"]["fwd_bwd_ms"] / result["flash"]["fwd_bwd_ms"], 3)
        result[name] = entry
    print(json.dumps(result), flush=True)


def versions(kernels: list[str]) -> dict:
    found = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    if "cudnn" in kernels:
        import cudnn
        import cudnn.sdpa.fwd.torch_op

        found |= {"cudnn_backend": cudnn.backend_version(), "cudnn_frontend": cudnn.__version__}
    if "fa4" in kernels:
        from importlib.metadata import version

        found["flash_attn_4"] = version("flash-attn-4")
        found["nvidia_cutlass_dsl"] = version("nvidia-cutlass-dsl")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="cudnn,fa4",
                        help=f"comma-separated, of {sorted(CALLS)}; torch's flash is the baseline")
    parser.add_argument("--cases", default="8:16384,56:16384,8:8192,1:16384",
                        help="group_size:token_budget rows")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/varlen_kernels.py measures a GPU: run it on one.")
    kernels = [k for k in opts.kernels.split(",") if k]
    unknown = set(kernels) - set(CALLS)
    if unknown:
        raise SystemExit(f"--kernels: unknown {sorted(unknown)}; choose from {sorted(CALLS)}")
    print(json.dumps(versions(kernels)), flush=True)
    for case in opts.cases.split(","):
        group_size, budget = (int(x) for x in case.split(":"))
        row_case(kernels, group_size, budget)


if __name__ == "__main__":
    main()
