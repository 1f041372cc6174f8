"""Where a training step's time goes when the trainer shares the CPU with its own rollout machinery.

Runs issue 21's task for `--steps` optimizer steps on the tiny random Qwen3 against a real
vLLM CPU server it starts (bf16, `--max-model-len 1024`, gloo weight sync, no core pinning
beyond vLLM's own): 256 conversational prompts alternating "Count from 1 to K." and
"What is a + b?", reward = share of the completion's non-space characters that are digits,
8 generations, `max_completion_length=64`, one micro-batch of `token_budget=2120` (about 32
samples), `learning_rate=1e-4`, `max_staleness=4`, a weight push every step, fp32 trainer on
one torch thread.

Per step it prints trained and generated tokens/s, the step's breakdown (forward+backward,
optimizer, weight sync, waiting for samples, pulling them, packing, metrics), each process's
CPU share read from /proc (trainer and its main thread, rollout worker, vLLM API server, engine
core) and generated tokens so far. After the run, with the worker stopped and the server idle,
each step's packed row is forwarded and backpropagated again in isolation: the summary's
`fwd_bwd_inflation` is the median of in-pipeline / isolated time of the same rows. `waste` is
generated tokens not trained per trained token (the server's own generation counter). The last
line is the summary as JSON; the first `--warmup` steps are left out of it.

    python bench/pipeline.py [--steps 30] [--warmup 3] [--profile DIR] [--base-url URL --server-pid PID]
        [--share-first-turn off] [--server-nice N]

`--share-first-turn off` sends one request per rollout for a group's first turns (the config's
`share_first_turn_request=False`, the path before issue 21's change) instead of one with n.
`--server-nice N` lowers the server's CPU priority (every thread of its process tree) before
training, so alternating runs against one server can compare priorities.

`--profile DIR` records py-spy's collapsed stacks (`--format raw`: one line per stack with its
sample count, greppable and the input of any flame-graph tool) of the trainer and the rollout
worker into DIR (py-spy on PATH), else a torch.profiler trace of the trainer.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
from proc_cpu import CpuShares, renice, server_processes

NUM_PROMPTS = 256
TOKEN_BUDGET = 2120


def task_dataset():
    from datasets import Dataset

    prompts = []
    for i in range(NUM_PROMPTS):
        if i % 2 == 0:
            text = f"Count from 1 to {3 + i % 17}."
        else:
            text = f"What is {i % 50} + {(7 * i) % 40}?"
        prompts.append([{"role": "user", "content": text}])
    return Dataset.from_dict({"prompt": prompts})


def digit_fraction(completions, **kwargs):
    """Share of the completion's non-whitespace characters that are digits (0 when empty)."""
    scores = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        chars = [c for c in text if not c.isspace()]
        scores.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return scores


class GeneratedTokens:
    """The server's `vllm:generation_tokens_total` at marked moments, read on a thread of its own.

    Reading it on the trainer's thread put the bench in the pipeline it measures: a `/metrics`
    round trip costs 16-37 ms per step at load 5-16 (and `httpx.get`, which builds an SSL context
    per call, 80-90 ms: 8.4 % of the trainer's py-spy samples). `mark(key)` returns at once; the
    reader takes marks in order, so each value is read a round trip after its step ended, which
    moves tokens between neighbouring steps but not out of the run's total."""

    def __init__(self, base_url: str) -> None:
        self.values: dict = {}
        self._http = httpx.Client(base_url=base_url, timeout=30)
        self._marks: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_marks, name="generated-tokens", daemon=True)
        self._reader.start()

    def mark(self, key) -> None:
        self._marks.put(key)

    def close(self) -> None:
        """Wait for every mark's value, then close the client."""
        self._marks.put(None)
        self._reader.join()
        self._http.close()

    def _read_marks(self) -> None:
        from grpo_agent.sampler.prometheus import parse_samples

        while (key := self._marks.get()) is not None:
            lines = [line for line in self._http.get("/metrics").text.splitlines()
                     if line.startswith("vllm:generation_tokens_total")]
            self.values[key] = sum(
                parse_samples("\n".join(lines)).get("vllm:generation_tokens_total", [0.0]))


# ---------------------------------------------------------------- step timers

class StepTimers:
    """Seconds spent in named trainer-side methods since the last `take()` (bench-side wraps,
    so the trainer needs no hooks beyond the perf/* metrics it logs)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list = []

    def wrap(self, owner, method: str, label: str) -> None:
        original = getattr(owner, method)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started

        setattr(owner, method, timed)
        self._undo.append((owner, method, original))

    def take(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds

    def restore(self) -> None:
        for owner, method, original in reversed(self._undo):
            setattr(owner, method, original)


# (module, class, method, label): the first of each label's candidates that exists is timed,
# so the bench follows the trainer's code as it moves between modules.
TIMED = [
    ("grpo_agent.train.step_source", "StepSource", "next_step", "next_step"),  # all three below
    ("grpo_agent.rollout.worker", "RolloutWorker", "pull", "waiting"),  # queue wait + unpickling
    ("grpo_agent.train.batching", "StepPlanner", "add", "packing_add"),  # inside next_step
    ("grpo_agent.train.batching", "StepPlanner", "plan", "packing_plan"),  # after it
    ("grpo_agent.train.step_source", "StepSource", "finish_step", "metrics"),  # worker metrics
    ("grpo_agent.train.trainer", "AsyncGRPOTrainer", "read_step_rows", "metrics"),
    ("grpo_agent.train.step_callback", "AsyncStepCallback", "_record_step_metrics", "metrics"),
    ("grpo_agent.train.trainer", "_AsyncStepCallback", "_record_step_metrics", "metrics"),
    ("grpo_agent.train.trainer", "AsyncGRPOTrainer", "log", "metrics"),
]


def instrument(timers: StepTimers, rows: list) -> None:
    import importlib

    from grpo_agent.train import trainer

    for module, owner, method, label in TIMED:
        try:
            cls = getattr(importlib.import_module(module), owner)
        except (ImportError, AttributeError):
            continue
        if method in vars(cls):
            timers.wrap(cls, method, label)
    original = trainer.AsyncGRPOTrainer.get_batch_samples

    def keep_rows(self, *args, **kwargs):
        batches, count = original(self, *args, **kwargs)
        rows.append(batches)
        return batches, count

    trainer.AsyncGRPOTrainer.get_batch_samples = keep_rows
    timers._undo.append((trainer.AsyncGRPOTrainer, "get_batch_samples", original))


# ---------------------------------------------------------------- the run

def make_recorder(trainer, server, timers: StepTimers, records: list, base_url: str):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """One record per logged step (logging_steps=1), taken right after the trainer logs.

        A record is printed once the server's generated-token count after its step is read
        (`GeneratedTokens`): usually at the next step, the last ones when training ends."""

        def __init__(self) -> None:
            self.shares = None
            self.last_t = time.perf_counter()
            self.generated_tokens = GeneratedTokens(base_url)
            self.generated_tokens.mark("start")
            self.last_mark, self.printed = "start", 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.last_t = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.generated_tokens.close()
            self.print_ready()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "perf/step_s" not in (logs or {}):
                return
            if self.shares is None:  # the worker exists once the pipeline started
                self.shares = CpuShares({
                    "trainer": (os.getpid(), None), "trainer_main_thread": (os.getpid(), os.getpid()),
                    "rollout_worker": [trainer.source.worker.pid],
                    **server_processes(server.pid)})
            now = time.perf_counter()
            self.generated_tokens.mark(state.global_step)
            records.append(step_record(state.global_step, logs, timers.take(), now - self.last_t,
                                       self.shares.shares()))
            records[-1]["after_mark"] = self.last_mark
            self.last_t, self.last_mark = now, state.global_step
            self.print_ready()

        def print_ready(self) -> None:
            values = self.generated_tokens.values
            while self.printed < len(records):
                record = records[self.printed]
                if record["step"] not in values:
                    return
                generated = values[record["step"]] - values[record.pop("after_mark")]
                record["generated_tokens"] = generated
                record["generated_tokens_per_s"] = round(generated / record["wall_s"], 1)
                print(json.dumps(record), flush=True)
                self.printed += 1

    return Recorder()


def step_record(step: int, logs: dict, timed: dict, wall: float, shares: dict) -> dict:
    """A step's record; its generated tokens are filled in once read (`Recorder.print_ready`)."""
    trained = logs.get("batch/trained_tokens_per_step", 0.0)
    waiting = timed.get("waiting", 0.0)
    adding = timed.get("packing_add", 0.0)
    return {
        "step": step, "wall_s": round(wall, 3),
        "trained_tokens": trained, "generated_tokens": None,
        "trained_tokens_per_s": round(trained / wall, 1), "generated_tokens_per_s": None,
        "fwd_bwd_s": round(logs.get("perf/fwd_bwd_s", 0.0), 3),
        "optimizer_s": round(logs.get("perf/optimizer_s", 0.0), 3),
        "sync_s": round(logs.get("perf/weight_sync_s", 0.0), 3),
        "waiting_s": round(waiting, 3),
        "pull_s": round(timed.get("next_step", 0.0) - waiting - adding, 3),
        "packing_s": round(adding + timed.get("packing_plan", 0.0), 3),
        "metrics_s": round(timed.get("metrics", 0.0), 3),
        "reward": logs.get("reward"),
        "cpu": shares,
    }


def isolated_fwd_bwd(trainer, batches: list) -> list[float]:
    """Each step's row forwarded and backpropagated again, alone (min of 2 after a warm-up)."""
    from grpo_agent.train.loss import build_loss_config

    model, config = trainer.model, build_loss_config(trainer.args, trainer.model)
    times = []
    for step_batches in batches:
        best = float("inf")
        for repeat in range(3 if not times else 2):
            started = time.perf_counter()
            for mb in step_batches:
                loss, _ = model.grpo_row_loss(mb.row, config, mb.num_trained_global)
                loss.backward()
            elapsed = time.perf_counter() - started
            model.zero_grad(set_to_none=True)
            if times or repeat > 0:
                best = min(best, elapsed)
        times.append(best)
    return times


@contextlib.contextmanager
def profiling(directory: str | None, pids_later):
    """py-spy flame graphs of the trainer and worker, or a torch.profiler trace."""
    if directory is None:
        yield lambda: None
        return
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy")
    recorders: list[subprocess.Popen] = []
    if spy:
        def attach():
            if recorders:
                return
            for name, pid in pids_later().items():
                recorders.append(subprocess.Popen(
                    [spy, "record", "--pid", str(pid), "--rate", "50", "--nonblocking",
                     "--format", "raw", "--output", str(out / f"{name}.txt")], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL))
        try:
            yield attach
        finally:
            for recorder in recorders:
                recorder.send_signal(2)  # SIGINT: py-spy writes its output and exits
            for recorder in recorders:
                recorder.wait(timeout=60)
        return
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield lambda: None
    prof.export_chrome_trace(str(out / "trainer_trace.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the summary")
    parser.add_argument("--profile", metavar="DIR", help="write py-spy / torch.profiler output here")
    parser.add_argument("--base-url", help="a server with the issue's flags that you started "
                        "(weights get pushed into it); needs --server-pid for its CPU share")
    parser.add_argument("--server-pid", type=int, help="the API server process of --base-url")
    parser.add_argument("--share-first-turn", choices=("on", "off"), default="on",
                        help="a group's first turns as one request with n (on) or one per rollout")
    parser.add_argument("--server-nice", type=int, metavar="N",
                        help="set the nice value of every thread of the server's processes before "
                        "training (0 undoes an earlier run's; default: leave them as they are)")
    opts = parser.parse_args()
    if opts.steps <= opts.warmup:
        raise SystemExit(f"--steps {opts.steps} must exceed --warmup {opts.warmup}.")
    import torch
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.sampler.server import ManagedVLLMServer
    from grpo_agent.testing import build_tiny_model

    model_path = str(build_tiny_model())
    timers, batches, records = StepTimers(), [], []
    load_before = os.getloadavg()
    if opts.base_url and not opts.server_pid:
        raise SystemExit("--base-url needs --server-pid (the API server's pid, for its CPU share).")
    server = (contextlib.nullcontext(argparse.Namespace(base_url=opts.base_url, pid=opts.server_pid))
              if opts.base_url else
              ManagedVLLMServer(model_path, dtype="bfloat16", max_model_len=1024, kv_cache_gib=2,
                                startup_timeout=1800))
    with tempfile.TemporaryDirectory() as tmp, server as server:
        if opts.server_nice is not None:
            renice(server.pid, opts.server_nice)
        args = AsyncGRPOConfig(
            output_dir=tmp, vllm_server_base_url=server.base_url, max_steps=opts.steps,
            num_generations=8, max_completion_length=64, token_budget=TOKEN_BUDGET,
            gradient_accumulation_steps=1, learning_rate=1e-4, max_staleness=4,
            weight_sync_steps=1, bf16=False, gradient_checkpointing=False, logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
            share_first_turn_request=opts.share_first_turn == "on")
        trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=digit_fraction,
                                   train_dataset=task_dataset(), args=args)
        instrument(timers, batches)
        trainer.add_callback(make_recorder(trainer, server, timers, records, server.base_url))
        pids = lambda: {"trainer": os.getpid(), "rollout_worker": trainer.source.worker.pid}
        with profiling(opts.profile, pids) as attach:
            from transformers import TrainerCallback

            class Attach(TrainerCallback):  # py-spy attaches once the worker runs
                def on_step_begin(self, *args, **kwargs):
                    attach()

            trainer.add_callback(Attach())
            started = time.perf_counter()
            trainer.train()
            run_s = time.perf_counter() - started
        timers.restore()
        torch.set_num_threads(1)
        isolated = isolated_fwd_bwd(trainer, batches)
    load_after = os.getloadavg()
    measured = records[opts.warmup:]
    for record, alone in zip(records, isolated):
        record["isolated_fwd_bwd_s"] = round(alone, 3)
    print(json.dumps({**summary(measured, isolated[opts.warmup:], run_s, load_before, load_after),
                      "share_first_turn": opts.share_first_turn, "server_nice": opts.server_nice}))


def summary(measured: list[dict], isolated: list[float], run_s: float, load_before, load_after) -> dict:
    def median(key):
        return round(statistics.median(r[key] for r in measured), 3)

    wall = sum(r["wall_s"] for r in measured)
    trained = sum(r["trained_tokens"] for r in measured)
    generated = sum(r["generated_tokens"] for r in measured)
    inflation = [r["fwd_bwd_s"] / alone for r, alone in zip(measured, isolated) if alone > 0]
    cpu = {name: round(statistics.mean(r["cpu"][name] for r in measured), 3)
           for name in measured[0]["cpu"]}
    rewards = [r["reward"] for r in measured if r["reward"] is not None]
    third = max(1, len(rewards) // 3)
    return {
        "summary": "pipeline", "steps_measured": len(measured), "run_s": round(run_s, 1),
        "trained_tokens_per_s": round(trained / wall, 1),
        "generated_tokens_per_s": round(generated / wall, 1),
        "waste_per_trained_token": round(max(generated - trained, 0.0) / trained, 3),
        "step_s": median("wall_s"), "fwd_bwd_s": median("fwd_bwd_s"),
        "isolated_fwd_bwd_s": round(statistics.median(isolated), 3),
        "fwd_bwd_inflation": round(statistics.median(inflation), 2),
        "optimizer_s": median("optimizer_s"), "sync_s": median("sync_s"),
        "waiting_s": median("waiting_s"), "pull_s": median("pull_s"),
        "packing_s": median("packing_s"), "metrics_s": median("metrics_s"),
        "cpu_share": cpu,
        "worker_cpu_s_per_1k_generated": round(
            1000 * cpu["rollout_worker"] * wall / generated, 3) if generated else None,
        "reward_first_third": round(statistics.mean(rewards[:third]), 3) if rewards else None,
        "reward_last_third": round(statistics.mean(rewards[-third:]), 3) if rewards else None,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
    }


if __name__ == "__main__":
    main()
