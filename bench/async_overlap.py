"""Async pipeline vs the same code run synchronously: wall time per optimizer step.

Both runs use the same trainer, worker, server and config (the `words` demo task on the tiny
model, learning_rate 0: this measures time, and a learning run would saturate the task and
starve both pipelines of samples). The synchronous run pauses the vLLM server while the trainer computes a step and
resumes it after the weight push, with `max_staleness=0`, so generation, training and sync take
turns exactly like a generate-then-train loop. From the synchronous run we read the generation
time per step (`perf/rollout_wait_s`: the trainer waiting for its samples) and the training time
(`perf/step_s` minus that wait); the ideal speedup of overlapping them is
(gen + train) / max(gen, train). Prints one JSON line per run and a summary line last.

Cores: on a GPU machine vLLM and the trainer run on different devices. The CPU analogue is
disjoint cores, so by default (`--split-cores`) the managed server's compute threads get the
first half of this process's cores and the trainer, with its rollout worker, the rest
(`grpo_agent.sampler.cpu_cores`, as `grpo-agent train` does with the server it starts); both
runs use the same split. `--no-split-cores` leaves them sharing every core, which measures CPU
contention as much as the pipeline.

Usage: python bench/async_overlap.py [--steps 30] [--vllm-url URL] [--no-split-cores]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from grpo_agent.sampler.cpu_cores import split_cores, trainer_on
from transformers import TrainerCallback

WARMUP_STEPS = 3


class PauseServerWhileTraining(TrainerCallback):
    """Synchronous mode: no generation between taking a step's samples and the weight push."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def _call(self, method: str) -> None:
        from grpo_agent.sampler.client import SamplerClient

        async def call():
            async with SamplerClient(self.base_url, timeout=60) as client:
                await getattr(client, method)()

        asyncio.run(call())

    def on_step_begin(self, args, state, control, **kwargs):
        self._call("pause")

    def on_step_end(self, args, state, control, **kwargs):
        self._call("resume")


def run(mode: str, base_url: str, model_path: str, steps: int, out_dir: Path) -> dict:
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.demo import letter_fraction, load_prompts
    from grpo_agent.train.reporting import JsonlMetricsCallback, read_metrics

    synchronous = mode == "sync"
    args = AsyncGRPOConfig(
        output_dir=str(out_dir / mode), vllm_server_base_url=base_url, max_steps=steps,
        num_generations=8, max_completion_length=64, learning_rate=0.0, report_to="none",
        save_strategy="no", gradient_checkpointing=False, optim="adamw_torch",
        gradient_accumulation_steps=2, max_staleness=0 if synchronous else 2,
        disable_tqdm=True,
    )
    callbacks = [JsonlMetricsCallback()]
    if synchronous:
        callbacks.append(PauseServerWhileTraining(base_url))
    trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=letter_fraction,
                               train_dataset=load_prompts(), args=args, callbacks=callbacks)
    trainer.train()
    rows = [r for r in read_metrics(out_dir / mode / "metrics.jsonl") if "perf/step_s" in r]
    rows = rows[WARMUP_STEPS:]
    step_s = statistics.mean(r["perf/step_s"] for r in rows)
    wait_s = statistics.mean(r["perf/rollout_wait_s"] for r in rows)

    def mean_of(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.mean(values) if values else None

    # Why generation per step can differ between the modes: the server's batch (concurrency)
    # and its throughput, and samples generated only to be dropped as stale.
    return {"mode": mode, "steps_measured": len(rows), "step_s": step_s, "rollout_wait_s": wait_s,
            "train_s": step_s - wait_s,
            "generated_tokens_per_s": mean_of("rollout/generated_tokens_per_s"),
            "concurrency": mean_of("rollout/concurrency"),
            "dropped_stale": sum(r.get("sample/dropped_stale_count") or 0 for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--vllm-url", default=None, help="a server you started (weights get pushed)")
    parser.add_argument("--split-cores", action=argparse.BooleanOptionalAction, default=True,
                        help="disjoint cores for the managed server and the trainer (default)")
    opts = parser.parse_args()
    from grpo_agent.testing import build_tiny_model

    model_path = str(build_tiny_model())
    split = split_cores() if opts.split_cores else None
    if opts.split_cores and split is None:
        raise SystemExit("--split-cores needs at least 2 cores; run with --no-split-cores")
    pinned = trainer_on(split.trainer) if split else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp:
        if opts.vllm_url:
            with pinned:
                results = [run(m, opts.vllm_url, model_path, opts.steps, Path(tmp))
                           for m in ("sync", "async")]
        else:
            from grpo_agent.sampler.server import ManagedVLLMServer

            env = split.server_env() if split else None
            with ManagedVLLMServer(model_path, dtype="float32", max_model_len=1024, env=env) as server, \
                    pinned:
                results = [run(m, server.base_url, model_path, opts.steps, Path(tmp))
                           for m in ("sync", "async")]
    cores = {"server_cores": split.server, "trainer_cores": split.trainer} if split else {}
    for result in results:
        print(json.dumps(result | cores))
    sync, async_ = results
    gen, train = sync["rollout_wait_s"], sync["train_s"]
    ideal = (gen + train) / max(gen, train)
    speedup = sync["step_s"] / async_["step_s"]
    print(json.dumps({
        "summary": "async_overlap", "split_cores": opts.split_cores, "gen_s": gen, "train_s": train,
        "sync_step_s": sync["step_s"], "async_step_s": async_["step_s"],
        "speedup": speedup, "ideal": ideal, "fraction_of_ideal": speedup / ideal,
    }))


if __name__ == "__main__":
    main()
