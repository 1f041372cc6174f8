"""The packed step of `packing.py` through CUDA graphs over bucketed row shapes (`row_graphs`).

Timed in the same process and on the same rows as the eager packed step, so every ratio is
side by side: one row with the GPU drained around it, the rows back to back, the log-prob and
gradient differences to the eager step (with the eager step's own rerun difference: flash's
dq and the gather's backward add atomically), and memory: the graphs' private pool after
`prepare` captured every row's bucket, against the eager step's peak over the same rows.
Several bucket sizes (`tokens:trained` steps) and captured tree paths (varlen, levels) run one
after another in the process, each with its own graphs. `kernel_profile` is the GPU kernel
table of one row, by kind.
"""

from __future__ import annotations

import torch
from grpo_agent.train import row_graphs
from grpo_agent.train.row_graphs import Bucket, RowGraphs


def _valid_logprob_sum(token, tensors):
    """The bench's loss (the sum of the trained tokens' log-probs), padding left out."""
    return (token.logprobs * tensors["valid"]).sum()


def _pool_gib(pool) -> float:
    """GiB reserved by one private (graph) pool."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) == tuple(pool)) / 2**30


def graph_case(model, packed_step, packed_rows, eager: dict, time_fn, peak_fn,
               steps: list[tuple], profile: bool = False) -> dict:
    """The packed step through CUDA graphs over bucketed rows (`row_graphs`), same rows and
    process as the eager packed lines (`eager`: their times, ratio and peak), once per
    (token step, trained step, *flags) in `steps`: time, exactness against the eager
    step, memory. Flags: "levels" captures the level tree path (else varlen); "arrival"
    captures each row's bucket as the row comes (the order before `prepare`), not largest
    first.
    `time_fn(step)` -> (median s, median queued s); `peak_fn(step)` -> peak GiB above what was
    allocated before. `profile`: each variant's kernel table of one replayed row."""
    row = packed_rows[0]

    def eager_grads():
        model.zero_grad(set_to_none=True)
        lp = packed_step(row).detach().float().clone()
        return lp, [p.grad.float() for p in model.parameters() if p.grad is not None]

    def rel_diff(grads, ref):
        num = sum(float((a - b).norm() ** 2) for a, b in zip(grads, ref)) ** 0.5
        return num / sum(float(b.norm() ** 2) for b in ref) ** 0.5

    eager_lp, eager_ref = eager_grads()
    eager_noise = rel_diff(eager_grads()[1], eager_ref)  # flash's dq and the gather add atomically
    model.zero_grad(set_to_none=True)
    eager_peak = max(peak_fn(lambda r=r: packed_step(r)) for r in packed_rows)
    torch.cuda.synchronize()  # the gradients exist; what the eager rows keep cached above them:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    reserved = torch.cuda.memory_reserved()
    for r in packed_rows:
        packed_step(r)
    torch.cuda.synchronize()
    eager_reserved = (torch.cuda.max_memory_reserved() - reserved) / 2**30
    model.zero_grad(set_to_none=True)
    ratio = row.unpacked_tokens / row.num_tokens
    out = {"eager_rerun_grad_rel_diff": eager_noise,
           "eager_packed_peak_gib": eager["packed_peak_gib"],
           "eager_packed_peak_all_rows_gib": round(eager_peak, 3),
           "eager_packed_reserved_all_rows_gib": round(eager_reserved, 3)}

    def measure(tokens_step: int, trained_step: int, *flags: str) -> dict:
        """One bucket size's graphs, made, timed and checked; freed on return."""
        row_graphs.STEPS.update(tokens=tokens_step, trained=trained_step)
        order = "arrival" if "arrival" in flags else "largest"
        backend = next((f for f in flags if f in row_graphs.BACKENDS), "varlen")
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        graphs = RowGraphs(model, _valid_logprob_sum, backend=backend)
        graphs.attach_grads()  # as the eager peak, measured above the gradients
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for rows in [packed_rows] if order == "largest" else [[r] for r in packed_rows]:
            graphs.prepare(rows)  # warm-ups, then captures largest first
        torch.cuda.synchronize()
        prepare_peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        pool = _pool_gib(graphs.pool)
        graph_lp = graphs.step(row).token.logprobs.float().clone()
        grad_diff = rel_diff([p.grad.float() for p in model.parameters() if p.grad is not None],
                             eager_ref)
        single_s, queued_s = time_fn(lambda: graphs.step(row))
        pipelined_s = time_fn(lambda: [graphs.step(r) for r in packed_rows])[0] / len(packed_rows)
        tag = (f"graph_{tokens_step}_{trained_step}_" + (f"{backend}_" if backend != "varlen" else "")
               + ("arrival_" if order != "largest" else ""))
        res = {
            tag + "buckets": len(graphs.graphs),
            tag + "padded_tokens": [Bucket.of(r, backend).tokens for r in packed_rows],
            tag + "padded_trained": [Bucket.of(r, backend).trained for r in packed_rows],
            tag + "packed_s": round(single_s, 5),
            tag + "queued_s": round(queued_s, 5),
            tag + "over_eager": round(single_s / eager["packed_s"], 3),
            tag + "speedup_over_ratio": round(eager["unpacked_s"] / single_s / ratio, 3),
            tag + "pipelined_packed_s": round(pipelined_s, 5),
            tag + "pipelined_over_eager": round(pipelined_s / eager["pipelined_packed_s"], 3),
            tag + "pipelined_speedup_over_ratio": round(
                eager["pipelined_unpacked_s"] / pipelined_s / eager["pipelined_ratio"], 3),
            tag + "max_logprob_diff": float((graph_lp - eager_lp).abs().max()),
            tag + "grad_rel_diff": grad_diff,
            tag + "prepare_peak_gib": round(prepare_peak, 3),
            tag + "replay_peak_gib": peak_fn(lambda: graphs.step(row)),
            tag + "pool_gib": round(pool, 3),
            tag + "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3),
        }
        if profile:
            res[tag + "profile"] = kernel_profile(lambda: graphs.step(row))
        model.zero_grad(set_to_none=True)
        return res

    for step in steps:
        out |= measure(*step)
    torch.cuda.empty_cache()
    return out


def _kind(name: str) -> str:
    n = name.lower()
    for kind, keys in (("attention", ("flash", "fmha")),
                       ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
                       ("lm_head", ("stats_kernel", "grad_kernel")),
                       ("index", ("index", "gather", "scatter")),
                       ("copy", ("memcpy", "memset", "copy")),
                       ("inductor", ("triton",))):
        if any(k in n for k in keys):
            return kind
    return "other"


def kernel_profile(step) -> dict:
    """GPU time (ms) and kernel count of one call of `step`, by kind, and its 12 longest
    kernels with the ops that launched them (none inside a graph replay): which kernels one
    path runs that another does not."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    launched: dict[str, set] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us() / 1e3
        for kernel in getattr(e, "kernels", ()):
            launched.setdefault(kernel.name, set()).add(e.name)
    kinds: dict[str, list] = {}
    for name, (count, ms) in kernels.items():
        k = kinds.setdefault(_kind(name), [0, 0.0])
        k[0] += count
        k[1] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    return {"total_ms": round(sum(ms for _, ms in kernels.values()), 3),
            "kernels": sum(c for c, _ in kernels.values()),
            "kinds": {k: [c, round(ms, 3)] for k, (c, ms) in sorted(kinds.items())},
            "top": [[name[:90], c, round(ms, 3), sorted(launched.get(name, ()))[:4]]
                    for name, (c, ms) in top]}
