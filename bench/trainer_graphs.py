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
line per variant, then a summary.

    python bench/trainer_graphs.py                              # qwen3-0.6b, 8k rows, G=8
    python bench/trainer_graphs.py --token-budget 16384 --model qwen3-1.7b
    python bench/trainer_graphs.py --device cpu --model tiny --variants eager --no-compile  # smoke
    python bench/trainer_graphs.py --variants eager --tree-backend masked  # FA4, tree as mask
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
        started = time.perf_counter()
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
    opts = parser.parse_args()
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
               "tree_backend": opts.tree_backend, "gc": opts.gc,
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
