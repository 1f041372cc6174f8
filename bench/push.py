"""Time of one merged-weight push of the tiny model over gloo, where it goes, and the old code
against the new on one server.

Each push is broken down by the trainer's side: every control call by route (HTTP round trip,
including the server's engine-core RPC), the broadcast of the packed bytes, and the rest
(gathering and packing the weights). `--old-core DIR` runs a second copy of the package (e.g.
`git worktree add /tmp/wt HEAD~1`, then `/tmp/wt/core`) in alternating child processes against
the same server, so both sides see the same load: the summary's `ratio` is new / old of the
median push time (each side's median over all its pushes). That the pushed weights are
the ones served is tests/sampler/test_weight_sync.py's job, not this bench's.

    python bench/push.py [--pushes 10] [--rounds 3] [--old-core DIR] [--base-url URL]

Without --base-url it starts a bf16 vLLM CPU server with the issue-21 flags. The last line
is the summary as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict


def one_side(base_url: str, model_path: str, pushes: int) -> dict:
    """`pushes` pushes (after one that opens the group) with per-route timings."""
    import torch
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.weight_sync import wire
    from grpo_agent.weight_sync.full import WeightPusher
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    args = AsyncGRPOConfig(output_dir="/tmp/bench_push", vllm_server_base_url=base_url,
                           report_to="none", use_cpu=True)
    pusher = WeightPusher(args, backend="gloo")
    sync = pusher._sync
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    original_call, original_broadcast = sync.control.call, wire.broadcast_from_trainer

    def timed_call(method, path, **kwargs):
        began = time.perf_counter()
        try:
            return original_call(method, path, **kwargs)
        finally:
            spent[f"http {path}"] += time.perf_counter() - began
            calls[path] += 1

    def timed_broadcast(group, buffer):
        began = time.perf_counter()
        original_broadcast(group, buffer)
        spent["broadcast"] += time.perf_counter() - began

    sync.control.call = timed_call
    module = sys.modules[type(sync).__module__]
    module.broadcast_from_trainer = timed_broadcast
    rows = []
    try:
        for version in range(pushes + 1):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 1e-3)
            spent.clear()
            calls.clear()
            began = time.perf_counter()
            pusher.push(model, version + 1000)
            total = time.perf_counter() - began
            if version == 0:
                continue  # opens the group
            # The broadcast runs inside the update route's call (the server receives, then
            # loads): `other_s` is the trainer's own gathering and packing.
            row = {"push_s": total, **{k: round(v, 4) for k, v in spent.items()},
                   "http_calls": sum(calls.values())}
            row["other_s"] = total - sum(v for k, v in spent.items() if k.startswith("http"))
            rows.append(row)
    finally:
        pusher.close()
    return {"rows": rows, "bytes": pusher.last_num_bytes}


def run_child(core: str | None, base_url: str, model_path: str, pushes: int) -> dict:
    env = dict(os.environ, GRPO_AGENT_LOAD_PLUGINS="")
    if core:
        env["PYTHONPATH"] = core + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--child", "--base-url", base_url,
                          "--model-path", model_path, "--pushes", str(pushes)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"child ({core or 'this checkout'}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pushes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-core", help="the old package's folder (put on PYTHONPATH)")
    parser.add_argument("--base-url")
    parser.add_argument("--model-path")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(one_side(opts.base_url, opts.model_path, opts.pushes)))
        return
    from grpo_agent.sampler.server import ManagedVLLMServer
    from grpo_agent.testing import build_tiny_model

    model_path = opts.model_path or str(build_tiny_model())
    server = (contextlib.nullcontext(argparse.Namespace(base_url=opts.base_url))
              if opts.base_url else
              ManagedVLLMServer(model_path, dtype="bfloat16", max_model_len=1024, kv_cache_gib=2,
                                startup_timeout=1800))
    sides = {"new": None} if not opts.old_core else {"old": opts.old_core, "new": None}
    pushes: dict[str, list[dict]] = defaultdict(list)
    load = [os.getloadavg()[0]]
    with server as server:
        for round_index in range(opts.rounds):
            order = list(sides.items())
            for side, core in order if round_index % 2 == 0 else order[::-1]:
                result = run_child(core, server.base_url, model_path, opts.pushes)
                pushes[side] += result["rows"]
                print(json.dumps({"round": round_index, "side": side,
                                  "median_push_s": statistics.median(
                                      r["push_s"] for r in result["rows"]),
                                  "bytes": result["bytes"],
                                  "last": result["rows"][-1]}), flush=True)
    load.append(os.getloadavg()[0])
    summary = {"load_avg": load}
    for side, rows in pushes.items():
        keys = sorted({k for r in rows for k in r})
        summary[side] = {k: round(statistics.median(r.get(k, 0.0) for r in rows), 4)
                         for k in keys}
        summary[side]["min_push_s"] = round(min(r["push_s"] for r in rows), 4)
    if "old" in summary:
        summary["ratio"] = round(summary["new"]["push_s"] / summary["old"]["push_s"], 3)
        summary["ratio_of_mins"] = round(summary["new"]["min_push_s"]
                                         / summary["old"]["min_push_s"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
