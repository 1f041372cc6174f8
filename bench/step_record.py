"""Per-step records of a training run beside a vLLM server, shared by `bench/pipeline.py` (ours)
and `bench/pipeline_trl.py` (TRL 1.16.0): one definition of a step's wall time, trained and
generated tokens, breakdown and CPU shares, so the two benches' numbers mean the same."""
from __future__ import annotations

import functools
import json
import os
import queue
import threading
import time
from collections import defaultdict

import httpx
from proc_cpu import CpuShares, server_processes

# What each mark reads: generated tokens, the engine's steps and their tokens (so how full its
# batches ran, which sets its CPU per token), and the sequences running at that moment.
SERVER_COUNTERS = ("vllm:generation_tokens_total", "vllm:iteration_tokens_total_sum",
                   "vllm:iteration_tokens_total_count", "vllm:num_requests_running")


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
                     if line.startswith(SERVER_COUNTERS)]
            samples = parse_samples("\n".join(lines))
            self.values[key] = {name: sum(samples.get(name, [0.0])) for name in SERVER_COUNTERS}



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


def make_recorder(worker_pid, server, timers: StepTimers, records: list, base_url: str):
    """`worker_pid()`: the rollout worker's pid, called once the pipeline runs (the worker
    starts with training); `bench/pipeline_trl.py` records TRL's trainer through this too."""
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
            # Every optimizer step logs its trained tokens (TRL's first step has no perf/step_s).
            if "batch/trained_tokens_per_step" not in (logs or {}):
                return
            if self.shares is None:  # the worker exists once the pipeline started
                self.shares = CpuShares({
                    "trainer": (os.getpid(), None), "trainer_main_thread": (os.getpid(), os.getpid()),
                    "rollout_worker": [worker_pid()],
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
                now, before = values[record["step"]], values[record.pop("after_mark")]
                generated = now["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
                record["generated_tokens"] = generated
                record["engine_steps"] = (now["vllm:iteration_tokens_total_count"]
                                          - before["vllm:iteration_tokens_total_count"])
                record["engine_tokens"] = (now["vllm:iteration_tokens_total_sum"]
                                           - before["vllm:iteration_tokens_total_sum"])
                record["server_running"] = now["vllm:num_requests_running"]
                record["generated_tokens_per_s"] = round(generated / record["wall_s"], 1)
                print(json.dumps(record), flush=True)
                self.printed += 1

    return Recorder()


def step_record(step: int, logs: dict, timed: dict, wall: float, shares: dict) -> dict:
    """A step's record; its generated tokens are filled in once read (`Recorder.print_ready`)."""
    trained = logs.get("batch/trained_tokens_per_step", 0.0)
    # TRL's trainer pulls samples inside its dataloader: its own `perf/rollout_wait_s` is the
    # wait, and there is no separate pull to time (`pull_s` None).
    waiting = timed.get("waiting", logs.get("perf/rollout_wait_s", 0.0))
    adding = timed.get("packing_add", 0.0)
    return {
        "step": step, "wall_s": round(wall, 3),
        "trained_tokens": trained, "generated_tokens": None,
        "trained_tokens_per_s": round(trained / wall, 1), "generated_tokens_per_s": None,
        "fwd_bwd_s": round(logs.get("perf/fwd_bwd_s", 0.0), 3),
        "optimizer_s": round(logs.get("perf/optimizer_s", 0.0), 3),
        "sync_s": round(logs.get("perf/weight_sync_s", 0.0), 3),  # the step's own wait
        "transfer_s": round(logs.get("perf/weight_sync_transfer_s", 0.0), 3),  # maybe overlapped
        "waiting_s": round(waiting, 3),
        "pull_s": round(timed["next_step"] - waiting - adding, 3) if "next_step" in timed else None,
        "packing_s": round(adding + timed.get("packing_plan", 0.0), 3),
        "metrics_s": round(timed.get("metrics", 0.0), 3),
        "reward": logs.get("reward"),
        "cpu": shares,
    }
