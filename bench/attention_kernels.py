"""Attention kernels torch offers on this GPU, forward+backward, bf16: a lead for tree rows.

Dense causal SDPA at 16k tokens per call through each SDPA backend (flash = FA2, cuDNN,
memory-efficient), and the varlen form the `levels` backend uses for a row's self part
(each segment causal on itself, q and k lengths equal, so causal alignment does not matter):
torch's flash varlen vs cuDNN's ragged kernel (`aten._cudnn_attention_forward/_backward`,
which torch 2.11's own `varlen_attn` leaves switched off; no GQA there, so K/V are expanded
to the query heads for every line of the comparison). Each line: median ms of 20 (CUDA
events), TFLOP/s of the causal pairs (x3.5 for forward+backward), and for cuDNN varlen the
largest difference to flash's output. A variant that torch rejects prints its error.

    python bench/attention_kernels.py
"""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F
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


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention_kernels.py measures a GPU: run it on one.")
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name()}), flush=True)
    dense(4, 4096)
    dense(16, 1024)
    varlen([1024] + [256] * 8 + [1024] + [256] * 8 + [1024] + [256] * 8 + [1024] + [256] * 8)
    varlen([4096] * 4)


if __name__ == "__main__":
    main()
