"""The trainer's own step with `cuda_graphs` off and on, on a GPU, same samples and weights.

`AsyncGRPOTrainer` trains `--steps` optimizer steps without a server (`testing.offline`: the
rollout worker is a script that hands over every sample at once): the step planner, tree
packing, the policy loss with score centering's top-k term, the loss metrics and fused AdamW all
run as in a real run. The model is a random Qwen3 shape in bf16 (`--compile`: decoder layers
compiled, as `torch_compile=True`); the samples are groups of `--group-size` sharing a prompt,
completions of varying length, the sampler's top `--topk` log-probs per token, about one
`--token-budget` row per step. Per variant: medians over the steps after `--warmup` of the rows'
device time (`perf/fwd_bwd_s`) and the step's wall time (`perf/step_s`; also its mean, which
carries the steps a full garbage collection hit: `--gc python` leaves the collector as it was
before `train/heap.py`), the whole run's wall time (captures included), row shapes captured,
peak memory, and the per-step losses' largest relative difference to the first variant. One JSON
line per variant, then a summary. `--profile N` also profiles N steps after the warm-up and says
where their wall time went: the GPU's busy and idle time, and per phase of the step (planning,
rows, gradient clipping, optimizer, step end, planning ahead, the step's read, logging) the
host's time and the GPU idle time that phase left (`step_phases`). `--plan-ahead off` plans
each step after the wait for the last one's rows, as the trainer did before `plan_ahead`;
`--swiglu off` keeps inductor's SwiGLU kernels, as before `train/swiglu.py`.

    python bench/trainer_graphs.py                              # qwen3-0.6b, 8k rows, G=8
    python bench/trainer_graphs.py --token-budget 16384 --model qwen3-1.7b
    python bench/trainer_graphs.py --device cpu --model tiny --variants eager --no-compile  # smoke
    python bench/trainer_graphs.py --variants eager --tree-backend masked  # FA4, tree as mask
    python bench/trainer_graphs.py --model qwen3-1.7b --token-budget 16384 --variants eager \
        --steps 12 --warmup 6 --profile 3                     # where the step's time goes
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import random
import statistics
import tempfile
import time

import torch
from grpo_agent import AsyncGRPOConfig
from grpo_agent.testing.offline import OfflineTrainer
from grpo_agent.top_logprobs import TopLogprobs
from grpo_agent.train import flash_impl
from grpo_agent.train.row_graphs import Bucket
from grpo_agent.types import TrainingSample, TrainingSequence
from packing import SHAPES, build_model
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback


def make_groups(steps: int, budget: int, group_size: int, prompt_len: int, completion_len: int,
                topk: int, vocab: int, seed: int) -> list[TrainingSample]:
    """Groups until `steps + 1` rows of `budget` tokens are covered (the last closes a step).
    Sampler log-probs near a random model's (-ln vocab), so importance ratios stay inside the
    clip range and the loss and its gradient are not zero."""
    gen = random.Random(seed)
    near = -math.log(vocab)
    samples, tokens, group = [], 0, 0
    while tokens < (steps + 1) * budget:
        prompt = [gen.randrange(vocab) for _ in range(prompt_len)]
        for i in range(group_size):
            comp = [gen.randrange(vocab)
                    for _ in range(gen.randint(completion_len // 2, completion_len * 3 // 2))]
            mask = [0] * prompt_len + [1] * len(comp)
            lps = [near + gen.uniform(-0.3, 0.3) if m else 0.0 for m in mask]
            top = TopLogprobs.from_dicts(  # as the rollout worker hands them over
                [{gen.randrange(vocab): near + gen.uniform(-0.3, 0.3) for _ in range(topk)}
                 if m else None for m in mask]) if topk else None
            samples.append(TrainingSample(
                TrainingSequence(prompt + comp, mask, lps, sampler_top_logprobs=top),
                advantage=gen.uniform(-1, 1), model_version=0, group_id=group,
                row_index=group, prompt_index=group, group_num_samples=group_size))
            tokens += len(comp) + 1
        tokens += prompt_len
        group += 1
    return samples


# The step's phases as the profile names them: trainer methods timed on the host (the optimizer
# step by torch's global step hooks).
PHASES = {"plan": "get_batch_samples", "row": "training_step", "clip_grad": "_clip_grad_norm",
          "step_end": "end_step", "plan_ahead": "plan_ahead", "step_read": "read_step_rows",
          "log": "log"}


@contextlib.contextmanager
def phases_recorded():
    """Each phase of PHASES (and the optimizer step) inside a profiler range of its name."""
    from grpo_agent.train.trainer import AsyncGRPOTrainer
    from torch.autograd.profiler import record_function
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    saved = {attr: getattr(AsyncGRPOTrainer, attr) for attr in PHASES.values()}
    for name, attr in PHASES.items():
        def timed(*args, _original=saved[attr], _name=name, **kwargs):
            with record_function(f"phase:{_name}"):
                return _original(*args, **kwargs)

        setattr(AsyncGRPOTrainer, attr, timed)
    open_ranges = []
    pre = register_optimizer_step_pre_hook(
        lambda *_: open_ranges.append(record_function("phase:optimizer").__enter__()))
    post = register_optimizer_step_post_hook(
        lambda *_: open_ranges.pop().__exit__(None, None, None))
    try:
        yield
    finally:
        pre.remove(), post.remove()
        for attr, original in saved.items():
            setattr(AsyncGRPOTrainer, attr, original)


def _union(intervals):
    """Merged [start, end) intervals, sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(spans, start, end) -> float:
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)


def step_phases(prof, steps: int) -> dict:
    """Where the profiled steps' wall time went: GPU busy/idle over the window, and per phase
    the host's time and the GPU's idle time while the host was in it (ms per step)."""
    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    ranges = [(e.name.split(":", 1)[1], e.time_range.start, e.time_range.end) for e in events
              if e.device_type.name == "CPU" and e.name.startswith("phase:")]
    start = min(s for _, s, _ in ranges)
    end = max(e for _, _, e in ranges)
    busy = _union([(max(s, start), min(e, end)) for s, e in kernels if e > start and s < end])
    edges = [start, *(t for span in busy for t in span), end]
    idle = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]  # busy's complement
    busy_ms = sum(e - s for s, e in busy) / 1e3
    per = {}
    for name, s, e in ranges:
        entry = per.setdefault(name, {"host_ms": 0.0, "gpu_idle_ms": 0.0, "calls": 0})
        entry["host_ms"] += (e - s) / 1e3
        entry["gpu_idle_ms"] += _overlap(idle, s, e) / 1e3
        entry["calls"] += 1
    covered = _union([(s, e) for _, s, e in ranges])
    outside_idle = sum(e - s for s, e in idle) - sum(_overlap(idle, s, e) for s, e in covered)
    return {"steps": steps, "wall_ms_per_step": round((end - start) / 1e3 / steps, 2),
            "gpu_busy_ms_per_step": round(busy_ms / steps, 2),
            "gpu_idle_ms_per_step": round(((end - start) / 1e3 - busy_ms) / steps, 2),
            "idle_outside_phases_ms_per_step": round(outside_idle / 1e3 / steps, 2),
            "phases": {k: {"host_ms_per_step": round(v["host_ms"] / steps, 2),
                           "gpu_idle_ms_per_step": round(v["gpu_idle_ms"] / steps, 2),
                           "calls": v["calls"]} for k, v in per.items()}}


class StepProfile(TrainerCallback):
    """torch.profiler over `steps` whole steps after step `after` (from the end of one step to
    the end of the last: each step's planning included)."""

    def __init__(self, after: int, steps: int):
        self.after, self.steps, self.prof, self.result = after, steps, None, None

    def on_step_end(self, args, state, control, **kwargs):
        from torch.profiler import ProfilerActivity, profile

        if state.global_step == self.after:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif self.prof is not None and state.global_step == self.after + self.steps:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.result, self.prof = step_phases(self.prof, self.steps), None


class StepLogs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "perf/step_s" in logs:
            self.logs.append(dict(logs))


def run_variant(graphs: bool, opts, samples, tokenizer) -> dict:
    cuda = opts.device == "cuda"
    model = build_model(opts.model, opts.device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        args = AsyncGRPOConfig(
            output_dir=out, max_steps=opts.steps, token_budget=opts.token_budget,
            gradient_checkpointing=False, torch_compile=opts.compile, cuda_graphs=graphs,
            bf16=cuda, use_cpu=not cuda, optim="adamw_torch_fused" if cuda else "adamw_torch", learning_rate=1e-6, logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True,
            num_sampler_logprobs=opts.topk)
        trainer = OfflineTrainer(model, args=args, reward_funcs=[], processing_class=tokenizer,
                                 train_dataset=[{"prompt": []}] * 64)
        trainer.samples = samples
        logs = StepLogs()
        trainer.add_callback(logs)
        trainer.remove_callback(PrinterCallback)
        profiler = StepProfile(opts.warmup, opts.profile) if opts.profile else None
        if profiler is not None:
            trainer.add_callback(profiler)
        started = time.perf_counter()
        with phases_recorded() if profiler is not None else contextlib.nullcontext():
            trainer.train()
        run_s = time.perf_counter() - started
        captured = trainer.graphed_rows.captured if graphs else 0
        buckets = list(trainer.graphed_rows.graphs.buffers) if graphs else []
        del trainer, model  # this variant's weights, optimizer state and graph pool
    gc.collect()
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    after = logs.logs[opts.warmup:]

    def median(key):
        return statistics.median(log[key] for log in after)

    trained = statistics.median(log["perf/wall_clock_trained_tokens_per_s"] for log in after)
    return {
        "variant": "cuda_graphs" if graphs else "eager",
        "steps": len(logs.logs), "timed_steps": len(after),
        "fwd_bwd_s": round(median("perf/fwd_bwd_s"), 5),
        "step_s": round(median("perf/step_s"), 5),
        "step_s_mean": round(statistics.mean(log["perf/step_s"] for log in after), 5),
        "trained_tokens_per_s": round(trained, 1),
        "fwd_bwd_mfu": round(median("perf/fwd_bwd_mfu"), 4) if "perf/fwd_bwd_mfu" in after[0]
        else None,
        "forwarded_tokens_per_step": median("batch/forwarded_tokens_per_step")
        if "batch/forwarded_tokens_per_step" in after[0] else None,
        "run_s": round(run_s, 2),
        "flash_impl": flash_impl.active() if cuda else None,
        "row_shapes_captured": captured,
        # how many values each bucket size took: which sizes make new shapes
        "distinct_per_size": {f.name: len({getattr(b, f.name) for b in buckets})
                              for f in dataclasses.fields(Bucket)} if graphs else None,
        "fwd_bwd_s_per_step": [round(log["perf/fwd_bwd_s"], 4) for log in logs.logs],
        "peak_gib": round(peak, 3) if cuda else None,
        "losses": [log["loss"] for log in logs.logs],
        "step_phases": profiler.result if profiler is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=list(SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=None, help="default: the shape's")
    parser.add_argument("--completion-len", type=int, default=None, help="default: the shape's")
    parser.add_argument("--topk", type=int, default=8, help="sampler top-k per token (0: none)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--variants", default="eager,cuda_graphs")
    parser.add_argument("--tree-backend", default="auto",
                        help="the tree attention path every row takes (auto: the trainer's "
                        "choice; e.g. varlen or masked to compare paths at one budget)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gc", default="managed", choices=["managed", "python"],
                        help="python: leave Python's cyclic collector as it is during planning "
                        "and the run (the trainer before train/heap.py), for a before/after")
    parser.add_argument("--plan-ahead", default="on", choices=["on", "off"],
                        help="off: plan each step after the wait for the last one's rows (the "
                        "trainer before plan_ahead), for a before/after")
    parser.add_argument("--profile", type=int, default=0,
                        help="profile this many steps after the warm-up (CUDA): step_phases")
    parser.add_argument("--swiglu", default="on", choices=["on", "off"],
                        help="off: the compiled layers keep inductor's own SwiGLU kernels (the "
                        "trainer before train/swiglu.py), for a before/after")
    opts = parser.parse_args()
    if opts.profile and (opts.device != "cuda" or opts.warmup + opts.profile > opts.steps):
        raise SystemExit("--profile needs --device cuda and warmup + profile <= steps")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/trainer_graphs.py needs a CUDA GPU (or --device cpu to smoke-test).")
    kwargs, _, prompt_len, completion_len, _ = SHAPES[opts.model]
    samples = make_groups(opts.steps, opts.token_budget, opts.group_size,
                          opts.prompt_len or prompt_len, opts.completion_len or completion_len,
                          opts.topk, kwargs["vocab_size"], opts.seed)
    from grpo_agent.testing import build_tiny_model

    if opts.tree_backend != "auto":  # the trainer asks `auto`; answer with the chosen path
        from grpo_agent.train import tree_attention

        tree_attention.choose_backend = lambda *args, **kwargs: opts.tree_backend

    if opts.plan_ahead == "off":
        from grpo_agent.train.trainer import AsyncGRPOTrainer

        AsyncGRPOTrainer.plan_ahead = lambda self, control: None
    if opts.swiglu == "off":
        from grpo_agent.train import swiglu

        swiglu.REWRITE_DEVICES = ()
    if opts.gc == "python":
        from grpo_agent.train import heap

        heap.cyclic_gc_paused = contextlib.nullcontext
        heap.freeze_long_lived = heap.thaw = lambda: None
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())  # unused without a server
    results = []
    for name in opts.variants.split(","):
        if name not in ("eager", "cuda_graphs"):
            raise SystemExit(f"--variants: {name!r} is not one of eager, cuda_graphs")
        res = run_variant(name == "cuda_graphs", opts, samples, tokenizer)
        if results:
            ref = results[0]["losses"]  # sums of random-sign terms: compare to their size
            res["max_loss_abs_diff"] = max(abs(a - b) for a, b in zip(res["losses"], ref))
            res["mean_abs_loss"] = statistics.mean(abs(b) for b in ref)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "losses"}), flush=True)
    summary = {"model": opts.model, "token_budget": opts.token_budget,
               "tree_backend": opts.tree_backend, "gc": opts.gc, "plan_ahead": opts.plan_ahead,
               "swiglu": opts.swiglu,
               "group_size": opts.group_size, "topk": opts.topk, "compile": opts.compile,
               "device": torch.cuda.get_device_name() if opts.device == "cuda" else "cpu"}
    if len(results) == 2:
        a, b = results
        summary |= {"step_s_ratio": round(a["step_s"] / b["step_s"], 3),
                    "fwd_bwd_s_ratio": round(a["fwd_bwd_s"] / b["fwd_bwd_s"], 3),
                    "trained_tokens_per_s_ratio": round(
                        b["trained_tokens_per_s"] / a["trained_tokens_per_s"], 3),
                    "run_s_ratio": round(a["run_s"] / b["run_s"], 3)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
