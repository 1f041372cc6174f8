"""How fast cuBLAS runs the packed step's own matmuls, alone: the ceiling for MFU.

For one Qwen3 shape and packed-row lengths, each projection's three GEMMs (forward
`x @ W.T`, input gradient `dy @ W`, weight gradient `dy.T @ x`) are timed alone (CUDA events,
median of 20) and reported in TFLOP/s against the device's peak, with the row length as
packed and rounded up to a multiple of 128, so a padded-row change is priced before it is
built. One JSON line per row length, the projection totals last.

    python bench/matmul_shapes.py --model qwen3-1.7b --tokens 14703,14848
"""

from __future__ import annotations

import argparse
import json

import torch
from attention_kernels import timed_ms
from grpo_agent.train import perf
from packing import SHAPES


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer of one decoder layer."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config[
        "num_key_value_heads"]
    head_dim, inter = config["head_dim"], config["intermediate_size"]
    return {"q": (hidden, heads * head_dim), "k": (hidden, kv * head_dim),
            "v": (hidden, kv * head_dim), "o": (heads * head_dim, hidden),
            "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[14703])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/matmul_shapes.py measures a GPU: run it on one.")
    config, dtype, *_ = SHAPES[args.model]
    peak = perf.peak_flops_per_s(torch.cuda.get_device_name(), "bf16")
    for tokens in args.tokens:
        for padded in sorted({tokens, -(-tokens // 128) * 128}):
            total_flops, total_s, parts = 0, 0.0, {}
            for name, (fan_in, fan_out) in projections(config).items():
                x = torch.randn(padded, fan_in, device="cuda", dtype=dtype)
                w = torch.randn(fan_out, fan_in, device="cuda", dtype=dtype)
                dy = torch.randn(padded, fan_out, device="cuda", dtype=dtype)
                flops = 2 * padded * fan_in * fan_out
                for kind, fn in (("fwd", lambda x=x, w=w: x @ w.T),
                                 ("dgrad", lambda dy=dy, w=w: dy @ w),
                                 ("wgrad", lambda dy=dy, x=x: dy.T @ x)):
                    s = timed_ms(fn) / 1e3
                    parts[f"{name}.{kind}"] = round(flops / s / peak, 3)
                    total_flops += flops
                    total_s += s
            # the count charges the tokens as packed, so padding's extra work shows as loss
            useful = total_flops * tokens / padded
            print(json.dumps({"model": args.model, "tokens": tokens, "gemm_rows": padded,
                              "layer_ms": round(total_s * 1e3, 3),
                              "fraction_of_peak": round(useful / total_s / peak, 4),
                              "per_gemm_fraction": parts}), flush=True)


if __name__ == "__main__":
    main()
