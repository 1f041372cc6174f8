"""The packed step of `packing.py` through CUDA graphs over bucketed row shapes (`row_graphs`).

Timed in the same process and on the same rows as the eager packed step, so every ratio is
side by side: one row with the GPU drained around it, the rows back to back, the log-prob and
gradient differences to the eager step (with the eager step's own rerun difference: flash's
dq and the gather's backward add atomically), and memory: the first step's peak (eager run +
capture), a replay's, and the graphs' private pool.
"""

from __future__ import annotations

import torch
from grpo_agent.train import row_graphs
from grpo_agent.train.row_graphs import Bucket, RowGraphs


def _valid_logprob_sum(token, tensors):
    """The bench's loss (the sum of the trained tokens' log-probs), padding left out."""
    return (token.logprobs * tensors["valid"]).sum()


def graph_case(model, packed_step, packed_rows, eager: dict, time_fn, peak_fn) -> dict:
    """The packed step through CUDA graphs over bucketed rows (`row_graphs`), same rows and
    process as the eager packed lines (`eager`: their times, ratio and peak): time, exactness
    against the eager step, memory. `time_fn(step)` -> (median s, median queued s);
    `peak_fn(step)` -> peak GiB above what was allocated before."""
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
    graphs = RowGraphs(model, _valid_logprob_sum)
    graphs.attach_grads()  # as the eager peak, measured above the gradients
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    graphs.step(row)  # the bucket's first row: an eager run, then the capture
    torch.cuda.synchronize()
    capture_peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    model.zero_grad(set_to_none=True)
    graph_lp = graphs.step(row).float().clone()  # a replay
    grad_diff = rel_diff([p.grad.float() for p in model.parameters() if p.grad is not None],
                         eager_ref)
    del eager_ref
    single_s, queued_s = time_fn(lambda: graphs.step(row))
    pipelined_s = time_fn(lambda: [graphs.step(r) for r in packed_rows])[0] / len(packed_rows)
    replay_peak = peak_fn(lambda: graphs.step(row))
    pool = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)) / 2**30
    ratio = row.unpacked_tokens / row.num_tokens
    out = {
        "graph_buckets": len(graphs.graphs),
        "graph_padded_tokens": [Bucket.of(r).tokens for r in packed_rows],
        "graph_packed_s": round(single_s, 5),
        "graph_packed_queued_s": round(queued_s, 5),
        "graph_over_eager": round(single_s / eager["packed_s"], 3),
        "graph_speedup_over_ratio": round(eager["unpacked_s"] / single_s / ratio, 3),
        "graph_pipelined_packed_s": round(pipelined_s, 5),
        "graph_pipelined_over_eager": round(pipelined_s / eager["pipelined_packed_s"], 3),
        "graph_pipelined_speedup_over_ratio": round(
            eager["pipelined_unpacked_s"] / pipelined_s / eager["pipelined_ratio"], 3),
        "graph_max_logprob_diff": float((graph_lp - eager_lp).abs().max()),
        "graph_grad_rel_diff": grad_diff,
        "eager_rerun_grad_rel_diff": eager_noise,
        "graph_token_step": row_graphs.STEPS["tokens"],
        "graph_capture_peak_gib": round(capture_peak, 3),
        "graph_replay_peak_gib": replay_peak,
        "graph_pool_gib": round(pool, 3),
        "eager_packed_peak_gib": eager["packed_peak_gib"],
    }
    model.zero_grad(set_to_none=True)
    return out  # the graphs and their pool go with this frame
