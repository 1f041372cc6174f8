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
core), generated tokens, and the server's engine steps, their tokens and the sequences running
when the step ended (`engine_tokens_per_step`, `server_running_median` in the summary: fuller
batches cost the engine less CPU per token). After the run, with the worker stopped and the server idle,
each step's packed row is forwarded and backpropagated again in isolation: the summary's
`fwd_bwd_inflation` is the median of in-pipeline / isolated time of the same rows. `waste` is
generated tokens not trained per trained token (the server's own generation counter). The last
line is the summary as JSON; the first `--warmup` steps are left out of it.

    python bench/pipeline.py [--steps 30] [--warmup 3] [--profile DIR] [--base-url URL --server-pid PID]
        [--share-first-turn off] [--server-nice N] [--background-push off] [--score-centering off]
        [--logprob-columns off]

`--logprob-columns off` has the rollout worker ask for vLLM's own log-prob form (an object per
top-k candidate) instead of columns (`GRPO_AGENT_LOGPROB_COLUMNS=0`; the columns need our vLLM
plugin in the server, which a managed or `vllm_entry` server loads). The summary's
`api_server_cpu_ms_per_1k_generated` is the API server's CPU per 1,000 generated tokens.

`--background-push off` pushes the weights inside the step (the path before the push moved off
the step's critical path); `sync_s` is the step's own part of the push, `transfer_s` the send.

`--score-centering off` trains GRPO's clipped surrogate and asks the server for no top-k
log-probs: the objective TRL 1.16.0's AsyncGRPOTrainer optimises (`bench/pipeline_trl.py`), so the
two pipelines compare on the same work; the default is the spec's score centering with the
sampler's top-8 per token, which costs the server CPU (docs/performance.md).

`--share-first-turn off` sends one request per rollout for a group's first turns (the config's
`share_first_turn_request=False`, the path before issue 21's change) instead of one with n.
The server runs at the CPU priority `grpo-agent train` gives the CPU server it starts
(`cpu_cores.SERVER_NICE`: its session's autogroup and every thread; see that module) for the
run, and at nice 0 again afterwards, so a TRL run against the same server
(`bench/pipeline_trl.py`) gets vLLM's default; `--server-nice N` picks another value (0: the
default, as before issue 21's change). Putting a shared server back to 0 needs root (or a
`RLIMIT_NICE` that allows it); the bench says so when it cannot.

`--profile DIR` records py-spy's collapsed stacks (`--format raw`: one line per stack with its
sample count, greppable and the input of any flame-graph tool) of the trainer and the rollout
worker into DIR (py-spy on PATH), else a torch.profiler trace of the trainer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from grpo_agent.sampler.cpu_cores import SERVER_NICE, lower_priority
from step_record import StepTimers, make_recorder

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


def pusher_in_the_step(args, model, facts):
    """The trainer's merged-weights pusher with every push inside its step (the old path)."""
    from grpo_agent.weight_sync.full import WeightPusher

    return WeightPusher(args, backend=facts.weight_transfer_backend, background=False)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The options this bench and `bench/pipeline_trl.py` share (one task, one server recipe)."""
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the summary")
    parser.add_argument("--base-url", help="a server with the issue's flags that you started "
                        "(weights get pushed into it); needs --server-pid for its CPU share")
    parser.add_argument("--server-pid", type=int, help="the API server process of --base-url")


def task_server(opts, model_path: str):
    """The server at --base-url, or a managed one with the issue's flags (bf16, 2 GiB KV cache,
    `--max-model-len 1024`, gloo weight transfer, dev mode, keep-alive 600 s)."""
    from grpo_agent.sampler.server import ManagedVLLMServer

    if opts.steps <= opts.warmup:
        raise SystemExit(f"--steps {opts.steps} must exceed --warmup {opts.warmup}.")
    if opts.base_url and not opts.server_pid:
        raise SystemExit("--base-url needs --server-pid (the API server's pid, for its CPU share).")
    if opts.base_url:
        return contextlib.nullcontext(argparse.Namespace(base_url=opts.base_url, pid=opts.server_pid))
    return ManagedVLLMServer(model_path, dtype="bfloat16", max_model_len=1024, kv_cache_gib=2,
                             startup_timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser)
    parser.add_argument("--profile", metavar="DIR", help="write py-spy / torch.profiler output here")
    parser.add_argument("--share-first-turn", choices=("on", "off"), default="on",
                        help="a group's first turns as one request with n (on) or one per rollout")
    parser.add_argument("--background-push", choices=("on", "off"), default="on",
                        help="let the weight push overlap the next step (on, the trainer's "
                        "default) or run it inside the step (off, the previous path)")
    parser.add_argument("--score-centering", choices=("on", "off"), default="on",
                        help="the spec's default loss, with the sampler's top-8 log-probs per "
                        "token (on), or GRPO's clipped surrogate with no top-k requested (off: "
                        "the objective TRL 1.16.0's trainer optimises)")
    parser.add_argument("--logprob-columns", choices=("on", "off"), default="on",
                        help="ask the server for log-probs as columns (on, the client's default) "
                        "or in vLLM's own form, an object per top-k candidate (off)")
    parser.add_argument("--server-nice", type=int, metavar="N", default=SERVER_NICE,
                        help="the server's CPU priority during the run (default: what "
                        f"grpo-agent train gives its CPU server, {SERVER_NICE}; 0: vLLM's default)")
    opts = parser.parse_args()
    # read by the sampler client of the rollout worker, a spawned child of this process
    os.environ["GRPO_AGENT_LOGPROB_COLUMNS"] = "1" if opts.logprob_columns == "on" else "0"
    import torch
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.testing import build_tiny_model

    model_path = str(build_tiny_model())
    timers, batches, records = StepTimers(), [], []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, task_server(opts, model_path) as server:
        lower_priority(server.pid, opts.server_nice)
        args = AsyncGRPOConfig(
            output_dir=tmp, vllm_server_base_url=server.base_url, max_steps=opts.steps,
            num_generations=8, max_completion_length=64, token_budget=TOKEN_BUDGET,
            gradient_accumulation_steps=1, learning_rate=1e-4, max_staleness=4,
            weight_sync_steps=1, bf16=False, gradient_checkpointing=False, logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
            share_first_turn_request=opts.share_first_turn == "on",
            score_centering=opts.score_centering == "on")
        trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=digit_fraction,
                                   train_dataset=task_dataset(), args=args)
        if opts.background_push == "off":
            trainer.pusher_factory = pusher_in_the_step
        instrument(timers, batches)
        trainer.add_callback(make_recorder(lambda: trainer.source.worker.pid, server, timers, records,
                                           server.base_url))
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
        if opts.base_url:  # the next run against this server (TRL's) gets vLLM's default
            lower_priority(server.pid, 0)
            if os.getpriority(os.PRIO_PROCESS, server.pid) != 0:
                print(f"could not set the server (pid {server.pid}) back to nice 0: run as root, "
                      "or restart the server before another side's run", flush=True)
    load_after = os.getloadavg()
    measured = records[opts.warmup:]
    for record, alone in zip(records, isolated):
        record["isolated_fwd_bwd_s"] = round(alone, 3)
    print(json.dumps({**summary(measured, isolated[opts.warmup:], run_s, load_before, load_after),
                      "share_first_turn": opts.share_first_turn, "server_nice": opts.server_nice,
                      "background_push": opts.background_push,
                      "score_centering": opts.score_centering,
                      "logprob_columns": opts.logprob_columns}))


def summary(measured: list[dict], isolated: list[float], run_s: float, load_before, load_after) -> dict:
    def median(key):
        values = [r[key] for r in measured if r[key] is not None]
        return round(statistics.median(values), 3) if values else None

    wall = sum(r["wall_s"] for r in measured)
    trained = sum(r["trained_tokens"] for r in measured)
    generated = sum(r["generated_tokens"] for r in measured)
    inflation = [r["fwd_bwd_s"] / alone for r, alone in zip(measured, isolated) if alone > 0]
    cpu = {name: round(statistics.mean(r["cpu"][name] for r in measured), 3)
           for name in measured[0]["cpu"]}
    rewards = [r["reward"] for r in measured if r["reward"] is not None]
    third = max(1, len(rewards) // 3)
    engine_steps = sum(r["engine_steps"] for r in measured)
    engine_tokens = sum(r["engine_tokens"] for r in measured)
    return {
        "summary": "pipeline", "steps_measured": len(measured), "run_s": round(run_s, 1),
        "trained_tokens_per_s": round(trained / wall, 1),
        "generated_tokens_per_s": round(generated / wall, 1),
        "waste_per_trained_token": round(max(generated - trained, 0.0) / trained, 3),
        "step_s": median("wall_s"), "fwd_bwd_s": median("fwd_bwd_s"),
        "isolated_fwd_bwd_s": round(statistics.median(isolated), 3),
        "fwd_bwd_inflation": round(statistics.median(inflation), 2),
        "optimizer_s": median("optimizer_s"), "sync_s": median("sync_s"),
        "transfer_s": median("transfer_s"),
        "waiting_s": median("waiting_s"), "pull_s": median("pull_s"),
        "packing_s": median("packing_s"), "metrics_s": median("metrics_s"),
        "cpu_share": cpu,
        "engine_tokens_per_step": round(engine_tokens / engine_steps, 1) if engine_steps else None,
        "server_running_median": median("server_running"),
        "worker_cpu_s_per_1k_generated": round(
            1000 * cpu["rollout_worker"] * wall / generated, 3) if generated else None,
        "api_server_cpu_ms_per_1k_generated": round(
            1e6 * cpu["api_server"] * wall / generated, 1) if generated and "api_server" in cpu
        else None,
        "reward_first_third": round(statistics.mean(rewards[:third]), 3) if rewards else None,
        "reward_last_third": round(statistics.mean(rewards[-third:]), 3) if rewards else None,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
    }


if __name__ == "__main__":
    main()
