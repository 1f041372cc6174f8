"""One layer's tree attention, forward+backward, through each GPU path on the same rows.

The paths exactly as a decoder layer calls them (bf16, 16 query heads over 8 key/value heads of
128 unless `--heads` says otherwise, bench/packing.py's rows): `varlen` (each segment against its
gathered path, one flash call, the gather's backward a scatter-add), `levels` (self part + one
part per depth, merged by log-sum-exp) and `masked` (one FlashAttention 4 call with the tree as
its mask_mod and block lists from the trie). Three timing-only variants of `masked` say what its
mask work costs (their results are wrong where the tree rule differs, so their differences are
large): `masked_causal` applies `j <= i` alone in the partial blocks (no per-key load of the
rule), `masked_full` lists every visible block as full (no mask work at all), `masked_noaux` is
`masked_causal` with no `aux_tensors` passed to FA4 (what handing it the rule's tensor costs the
host). torch's flash ops run FlashAttention 4 when `--flash-impl FA4`, so the first two use the
same kernels as the third. Per path: median ms of `--repeats` (CUDA events), TFLOP/s over the
tree's visible pairs (x3.5 for forward+backward, as perf counts them), the plan's build time
(median of `--repeats` builds after a first one, which every training row pays), and the largest
output and gradient differences to the first path. Eager: the times include the host queueing each
path's kernels; `host_ms` is the host's own time to queue one forward+backward with the GPU
drained before (median), and `--host-profile N` prints the N functions holding most of it
(cProfile, own time).

    PYTHONPATH=core:bench python bench/tree_paths.py --flash-impl FA4
    PYTHONPATH=core:bench python bench/tree_paths.py --heads 8:2:256   # Qwen3.5's attention
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import functools
import io
import json
import pstats
import statistics
import time

import torch
from attention_kernels import timed_ms
from grpo_agent.train import flash_impl
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import TreeMask, dense_tree_mask, tree_attention_forward
from packing import make_samples

HEADS = (16, 8, 128)  # query heads, key/value heads, head width (Qwen3-1.7B's)


class _Layer(torch.nn.Module):
    """What tree_attention_forward reads from a transformers attention module."""

    training = True


def visible(row) -> int:
    return int(dense_tree_mask(row.segment_ids, row.segment_ancestors).sum())


@contextlib.contextmanager
def fa4_backward_config(override: dict):
    """FA4's Hopper backward with these fields of its tile config replaced (a sweep for the
    masked path; flash-attn-4 picks one config per head width and does not take one)."""
    from flash_attn.cute import interface

    original = interface._tile_size_bwd_sm90
    interface._tile_size_bwd_sm90 = lambda *a, **kw: dataclasses.replace(original(*a, **kw),
                                                                         **override)
    try:
        yield
    finally:
        interface._tile_size_bwd_sm90 = original


TIMING_ONLY = ("masked_causal", "masked_full", "masked_noaux")


@functools.cache
def _causal_mask_mod():
    from cutlass import cute

    @cute.jit
    def causal_only(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return n_idx <= m_idx

    return causal_only


@contextlib.contextmanager
def timing_variant(path: str, tree):
    """`masked_causal` / `masked_full` / `masked_noaux` from a masked plan (module docstring)."""
    from flash_attn.cute import interface
    from grpo_agent.train import masked_attention as ma

    plan, original = tree.masked, ma.tree_mask_mod
    calls = interface._flash_attn_fwd, interface._flash_attn_bwd
    if path == "masked_full":
        _, visible, _ = ma.block_pairs(plan.until, plan.key_block)
        none = visible & False
        plan.blocks = [*ma._lists(none), *ma._lists(visible), *ma._lists(none.T),
                       *ma._lists(visible.T)]
    elif path in ("masked_causal", "masked_noaux"):
        ma.tree_mask_mod = _causal_mask_mod
    if path == "masked_noaux":
        interface._flash_attn_fwd, interface._flash_attn_bwd = (
            functools.wraps(call)(functools.partial(_without_aux, call)) for call in calls)
    try:
        yield
    finally:
        ma.tree_mask_mod = original
        interface._flash_attn_fwd, interface._flash_attn_bwd = calls


def _without_aux(call, *args, **kwargs):
    kwargs["aux_tensors"] = None
    return call(*args, **kwargs)


def host_ms(step, repeats: int, profile_lines: int = 0) -> float:
    """Median host time to queue `step` with the GPU drained before; with `profile_lines`,
    print the functions holding it (one cProfile of `repeats` calls, own time)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    if profile_lines:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(repeats):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile_lines)
        print(text.getvalue(), flush=True)
    return statistics.median(times)


def case(paths: list[str], group_size: int, budget: int, repeats: int, prompt_len: int,
         completion_len: int, heads: tuple[int, int, int] = HEADS,
         bwd_configs: list[dict] | None = None, profile_lines: int = 0) -> list[dict]:
    row = pack_row(make_samples(group_size, prompt_len, completion_len, budget, 1000, 0))
    n, (q_heads, kv_heads, dim) = row.num_tokens, heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, q_heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    grad = torch.randn(1, n, q_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    pairs, layer, lines, first = visible(row), _Layer(), [], None
    runs = [(p, c) for p in paths for c in (bwd_configs if p == "masked" and bwd_configs
                                            else [None])]
    for path, bwd_config in runs:
        patch = fa4_backward_config(bwd_config) if bwd_config else contextlib.nullcontext()
        build = functools.partial(TreeMask.build, row, "cuda",
                                  "masked" if path in TIMING_ONLY else path,
                                  dtype=torch.bfloat16, head_dim=dim)
        tree = build()  # the first build also pays one-off kernel loading
        builds = []
        for _ in range(repeats):  # what each training row pays: host and GPU, drained after
            torch.cuda.synchronize()
            start = time.perf_counter()
            build()
            torch.cuda.synchronize()
            builds.append((time.perf_counter() - start) * 1e3)
        build_ms = statistics.median(builds)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def step(tree=tree, leaves=leaves):
            for t in leaves:
                t.grad = None
            out, _ = tree_attention_forward(layer, *leaves, None, scaling=dim ** -0.5,
                                            tree_mask=tree)
            out.backward(grad)
            return out

        if path in TIMING_ONLY:
            patch = timing_variant(path, tree)
        try:
            with patch:
                out = step()
                results = [out.float(), *(t.grad.float() for t in leaves)]
                ms = timed_ms(step, repeats)
                queue_ms = host_ms(step, repeats, profile_lines)
        except Exception as exc:  # noqa: BLE001 -- a config FA4 cannot build: say so, go on
            print(json.dumps({"path": path, "fa4_bwd_config": bwd_config,
                              "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
            continue
        line = {"case": f"G={group_size}/{budget}", "heads": "{}:{}:{}".format(*heads),
                "tokens": n, "path": path,
                "flash_impl": flash_impl.active(), "fwd_bwd_ms": round(ms, 3),
                "host_ms": round(queue_ms, 3),
                "tflops": round(3.5 * 4 * pairs * q_heads * dim / ms / 1e9, 1),
                "plan_build_ms": round(build_ms, 2)}
        if bwd_config is not None:
            line["fa4_bwd_config"] = bwd_config
        if first is None:
            first = results
        else:
            line["max_diff_out_dq_dk_dv"] = [round((a - b).abs().max().item(), 4)
                                             for a, b in zip(results, first)]
        lines.append(line)
        print(json.dumps(line), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="varlen,levels,masked")
    parser.add_argument("--cases", default="8:16384,56:16384,8:8192,8:4096",
                        help="comma-separated group_size:token_budget")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--flash-impl", default="FA4", choices=flash_impl.CHOICES[1:])
    parser.add_argument("--heads", default="{}:{}:{}".format(*HEADS),
                        type=lambda text: tuple(int(x) for x in text.split(":")),
                        help="query heads:key/value heads:head width")
    parser.add_argument("--fa4-bwd-configs", type=json.loads, default=None,
                        help="masked path once per entry: fields of FA4's Hopper BwdConfig to "
                        "replace, e.g. '[{}, {\"m_block_size\": 128, \"num_stages_Q\": 1}]'")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="print the N functions holding most host time, per path")
    args = parser.parse_args()
    flash_impl.use(args.flash_impl)
    lines = []
    for spec in args.cases.split(","):
        group_size, budget = (int(x) for x in spec.split(":"))
        lines += case(args.paths.split(","), group_size, budget, args.repeats, args.prompt_len,
                      args.completion_len, args.heads, args.fa4_bwd_configs, args.host_profile)
    print(json.dumps({"summary": [(r["case"], r["path"], r.get("fa4_bwd_config"), r["fwd_bwd_ms"])
                                  for r in lines]}))


if __name__ == "__main__":
    main()
