"""The LM head's log-probs alone: the torch tiles vs the fused Triton kernels, same inputs.

Forward+backward of `token_logprobs` (target log-probs summed with random weights, so every
gradient path runs) for a few token counts and hidden sizes at Qwen3's vocabulary, alternating
the two paths; CUDA events, median of `--repeats`. Each line: seconds per path and their ratio,
peak extra memory, and the relative error (||a - ref|| / ||ref||) of log-probs, entropy and
both gradients against a float32 full-logits reference. The last line is the summary.

    python bench/lm_head.py                 # CUDA only
    python bench/lm_head.py --tokens 4096,16384 --hidden 1024,2048
    python bench/lm_head.py --configs '[{"BV": 256}, {"GT": 128}]'   # kernel configs side by side
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from grpo_agent.train import fused_lm_head, logprobs

DEFAULT_CONFIG = dict(fused_lm_head.CONFIG)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def reference(hidden, weight, targets, w):
    """float32 full logits (TF32 off): log-probs, entropy, d hidden, d weight."""
    h = hidden.detach().float().requires_grad_()
    wt = weight.detach().float().requires_grad_()
    logp = torch.log_softmax(h @ wt.T, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    lp = logp.gather(1, targets[:, None]).squeeze(1)
    (lp * w).sum().backward()
    return lp.detach(), entropy.detach(), h.grad, wt.grad


def run(path: str, hidden, weight, targets, w, configs=({},)):
    """path "torch", or "triton<i>": the kernels with DEFAULT_CONFIG updated by configs[i]."""
    logprobs.LM_HEAD = path.rstrip("0123456789")
    if path.startswith("triton"):
        fused_lm_head.CONFIG = {**DEFAULT_CONFIG, **configs[int(path[6:] or 0)]}
    hidden.grad = weight.grad = None
    out = logprobs.token_logprobs(hidden, weight, targets)
    (out.logprobs * w).sum().backward()
    return out.logprobs.detach(), out.entropy, hidden.grad, weight.grad


def time_path(path, hidden, weight, targets, w, repeats, configs):
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run(path, hidden, weight, targets, w, configs)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return times


def peak_gib(path, hidden, weight, targets, w, configs) -> float:
    torch.cuda.synchronize()
    hidden.grad = weight.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run(path, hidden, weight, targets, w, configs)
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def case(tokens: int, hidden_size: int, vocab: int, repeats: int, temperature_check: bool,
         configs: list[dict]):
    gen = torch.Generator(device="cuda").manual_seed(tokens + hidden_size)
    hidden = (torch.randn(tokens, hidden_size, device="cuda", generator=gen)
              .bfloat16().requires_grad_())
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.05
              ).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    w = torch.randn(tokens, device="cuda", generator=gen)
    paths = ["torch", *(f"triton{i}" for i in range(len(configs)))]
    for path in paths:  # warm-up, compilation
        for _ in range(2):
            run(path, hidden, weight, targets, w, configs)
    times = {path: [] for path in paths}
    for _ in range(2):  # alternate, in halves
        for path in times:
            times[path] += time_path(path, hidden, weight, targets, w, max(1, repeats // 2),
                                     configs)
    out = {"case": "lm_head", "tokens": tokens, "hidden": hidden_size, "vocab": vocab}
    for path, seconds in times.items():
        out[f"{path}_s"] = round(statistics.median(seconds), 5)
    for i in range(len(configs)):
        out[f"triton{i}_over_torch"] = round(out[f"triton{i}_s"] / out["torch_s"], 3)
    for path in times:
        out[f"{path}_peak_gib"] = peak_gib(path, hidden, weight, targets, w, configs)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = reference(hidden, weight, targets, w)
    for path in times:
        got = run(path, hidden, weight, targets, w, configs)
        for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), got, ref):
            out[f"{path}_rel_err_{name}"] = round(_rel(a, b), 6)
        out[f"{path}_max_abs_err_logprobs"] = round(float((got[0] - ref[0]).abs().max()), 5)
    del ref
    if temperature_check:  # temperature != 1: both paths against each other
        logprobs.LM_HEAD = "torch"
        a = logprobs.token_logprobs(hidden, weight, targets, temperature=0.7)
        run("triton0", hidden, weight, targets, w, configs)
        b = logprobs.token_logprobs(hidden, weight, targets, temperature=0.7)
        out["t0.7_max_abs_diff_logprobs"] = round(
            float((a.logprobs - b.logprobs).detach().abs().max()), 5)
    logprobs.LM_HEAD = "auto"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 8192, 16384])
    parser.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1024, 2048])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--configs", type=json.loads, default=[{}],
                        help="JSON list of kernel configs (updates of fused_lm_head.CONFIG), "
                        "timed side by side as triton0, triton1, ...")
    parser.add_argument("--no-float32-addmm", action="store_true",
                        help="accumulate d hidden with a matmul and an add (the fallback)")
    args = parser.parse_args()
    fused_lm_head.FLOAT32_ADDMM = not args.no_float32_addmm
    if not torch.cuda.is_available():
        raise SystemExit("bench/lm_head.py compares CUDA kernels: run it on a GPU.")
    results = []
    for hidden_size in args.hidden:
        for tokens in args.tokens:
            results.append(case(tokens, hidden_size, args.vocab, args.repeats, not results,
                                args.configs))
            print(json.dumps(results[-1]), flush=True)
            torch.cuda.empty_cache()
    print(json.dumps({
        "summary": "lm_head", "device": torch.cuda.get_device_name(),
        "default_config": DEFAULT_CONFIG, "configs": args.configs,
        "float32_addmm": fused_lm_head.FLOAT32_ADDMM,
        "triton_over_torch": [(r["tokens"], r["hidden"],
                               *(r[f"triton{i}_over_torch"] for i in range(len(args.configs))))
                              for r in results],
    }), flush=True)


if __name__ == "__main__":
    main()
