"""Same seed, same losses: does a refactor change what the trainer computes?

A fixed-seed run is not reproducible end to end: the rollout worker is asynchronous (which
groups a pull brings depends on timing) and a CPU vLLM server samples without per-request
seeds. So the check replays instead of regenerating:

1. `record`: one real run of the demo config (the `words` task, tiny model, seed 1, 6 steps)
   against a real vLLM server. Every non-empty batch the trainer read from the worker's sample
   queue (raw, before the staleness rule) and every batch of worker metrics it drained is
   pickled, in order.
2. `replay`: the same config, with the worker process replaced by those recordings: pull k gets
   the raw items of recorded pull k (the trainer's staleness rule, step filling, ledger, loss,
   optimizer, weight push and metric window all run for real), drain k the worker metrics of
   recorded drain k. Prints the logged metrics of every step, timing metrics left out.
3. `compare A B`: exact equality of two replays, step by step and key by key.

Run `replay` on the code before the change (PYTHONPATH=<old tree>/core) and after, on the same
recording; run it twice on the old tree to see that a replay is deterministic. A replay that
pulls more batches than were recorded fails loudly (the step filling changed).

Issue 16 (2026-12-02, CPU vLLM, tiny model): one recording (31 pulls, 6 drains), replayed
twice on the tree before the refactor and once on the tree after it: all three give the
recording's six losses and are identical in every compared value (282 per run). A replay on a
copy whose drop rule was broken (`>=` instead of `>` max_staleness) fails.

Usage:
  python bench/same_losses.py record --out DIR [--vllm-url URL]
  python bench/same_losses.py replay --recording DIR --out FILE.json [--vllm-url URL]
  python bench/same_losses.py compare A.json B.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import pickle
import sys
import tempfile
from pathlib import Path

STEPS = 6
TIMING_MARKERS = ("perf/", "_s", "per_s", "time", "mfu", "runtime", "flos")


def _config(out_dir: Path, base_url: str):
    from grpo_agent import AsyncGRPOConfig

    # `make demo`'s settings (Makefile), with a fixed number of steps.
    return AsyncGRPOConfig(
        output_dir=str(out_dir), vllm_server_base_url=base_url, max_steps=STEPS, seed=1,
        learning_rate=0.0003, num_generations=8, max_completion_length=16,
        gradient_checkpointing=False, optim="adamw_torch", save_strategy="no",
        report_to="none", disable_tqdm=True, logging_steps=1)


def _worker_classes():
    """Every module attribute through which the trainer builds its rollout worker."""
    import importlib

    names = ["grpo_agent.rollout.worker", "grpo_agent.train.trainer", "grpo_agent.train.step_source",
             "grpo_agent.train.pipeline"]
    modules = []
    for name in names:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "RolloutWorker"):
                modules.append(module)
    return modules


def _install(worker_cls) -> None:
    for module in _worker_classes():
        module.RolloutWorker = worker_cls


def _train(out_dir: Path, base_url: str, model_path: str) -> list[dict]:
    from grpo_agent import AsyncGRPOTrainer
    from grpo_agent.demo import letter_fraction, load_prompts
    from grpo_agent.train.reporting import JsonlMetricsCallback, read_metrics

    trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=letter_fraction,
                               train_dataset=load_prompts(), args=_config(out_dir, base_url),
                               callbacks=[JsonlMetricsCallback()])
    trainer.train()
    return [row for row in read_metrics(out_dir / "metrics.jsonl") if "loss" in row]


def record(out: Path, base_url: str, model_path: str) -> None:
    from grpo_agent.rollout.worker import RolloutWorker

    pulls: list[list] = []
    drains: list[list] = []

    class RecordingWorker(RolloutWorker):
        def _drop_stale(self, items):
            pulls.append(pickle.loads(pickle.dumps(items)))
            return super()._drop_stale(items)

        def drain_metrics(self):
            self._child_batch = []
            observations = super().drain_metrics()
            drains.append(self._child_batch)
            return observations

        def _read_metrics_queue(self):
            observations = super()._read_metrics_queue()
            getattr(self, "_child_batch", []).extend(observations)
            return observations

    _install(RecordingWorker)
    with tempfile.TemporaryDirectory() as tmp:
        rows = _train(Path(tmp), base_url, model_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recording.pkl").write_bytes(pickle.dumps({"pulls": pulls, "drains": drains}))
    print(json.dumps({"recorded_pulls": len(pulls), "recorded_drains": len(drains),
                      "losses": [row["loss"] for row in rows]}))


class _ReplayQueue:
    """The sample queue of a replayed worker: each pull reads one recorded batch."""

    def __init__(self) -> None:
        self.batch: list = []

    def get(self, timeout=None):
        import queue

        if not self.batch:
            raise queue.Empty
        return self.batch.pop(0)

    def get_nowait(self):
        return self.get()

    def qsize(self) -> int:
        return len(self.batch)

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class _AliveProcess:
    pid = None
    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        pass


def replay(recording: Path, out: Path, base_url: str, model_path: str) -> None:
    import time

    from grpo_agent.rollout.worker import RolloutWorker

    data = pickle.loads((recording / "recording.pkl").read_bytes())
    pulls, drains = list(data["pulls"]), list(data["drains"])

    class ReplayWorker(RolloutWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._replay_queue = _ReplayQueue()

        def start(self) -> None:
            self._process = _AliveProcess()
            self._set_heartbeat()

        def _set_heartbeat(self) -> None:
            heartbeat = getattr(self, "_heartbeat", None) or self.channels.heartbeat
            heartbeat.value = time.time()

        def stop(self, grace_s: float = 0.0) -> None:
            self._stopped = True

        def pull(self, timeout):
            if not pulls:
                raise SystemExit("replay: the trainer pulled more batches than were recorded")
            self._replay_queue.batch = list(pulls.pop(0))
            self._set_heartbeat()
            self._swap_queue()
            return super().pull(timeout)

        def _swap_queue(self) -> None:
            if hasattr(self, "channels"):
                self.channels.samples = self._replay_queue
            else:
                self._buffer = self._replay_queue

        def _read_metrics_queue(self):
            return []

        def drain_metrics(self):
            observations = super().drain_metrics()
            return observations + (drains.pop(0) if drains else [])

        def flush_metrics(self, timeout_s: float = 0.0) -> bool:  # trees before `finish`
            return True

        def finish(self, timeout_s: float = 0.0) -> bool:
            return True

    _install(ReplayWorker)
    _no_initial_push()
    from grpo_agent.train import step_source

    # The old tree's last step slept for the worker's last metric flush: nothing to wait for.
    if hasattr(step_source, "METRICS_FLUSH_INTERVAL_S"):
        step_source.METRICS_FLUSH_INTERVAL_S = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        rows = _train(Path(tmp), base_url, model_path)
    steps = [{k: v for k, v in row.items() if not any(m in k for m in TIMING_MARKERS)}
             for row in rows]
    out.write_text(json.dumps({"steps": steps, "unreplayed_pulls": len(pulls),
                               "unreplayed_drains": len(drains)}, indent=1, sort_keys=True))
    print(json.dumps({"steps": len(steps), "losses": [row.get("loss") for row in steps],
                      "unreplayed_pulls": len(pulls)}))


def _no_initial_push() -> None:
    """The recording ran on a fresh server (no push before the first step); the server a replay
    pushes into already holds pushed weights, which would start the run one version later."""
    import importlib

    for name in ("grpo_agent.train.trainer", "grpo_agent.train.pipeline"):
        module = importlib.import_module(name) if _importable(name) else None
        build = getattr(module, "build_weight_pusher", None)
        if build is None:
            continue

        def build_without_initial_push(*args, _build=build, **kwargs):
            pusher = _build(*args, **kwargs)
            pusher.needs_initial_push = lambda *a, **k: False
            return pusher

        module.build_weight_pusher = build_without_initial_push
    from grpo_agent import AsyncGRPOTrainer

    if "pusher_factory" in vars(AsyncGRPOTrainer):  # the trainer holds the builder
        build = AsyncGRPOTrainer.pusher_factory

        def factory_without_initial_push(*args, **kwargs):
            pusher = build(*args, **kwargs)
            pusher.needs_initial_push = lambda *a, **k: False
            return pusher

        AsyncGRPOTrainer.pusher_factory = staticmethod(factory_without_initial_push)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def compare(a: Path, b: Path) -> int:
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    problems = []
    if len(left["steps"]) != len(right["steps"]):
        problems.append(f"{len(left['steps'])} vs {len(right['steps'])} steps")
    compared = 0
    for step, (x, y) in enumerate(zip(left["steps"], right["steps"]), 1):
        for key in sorted(set(x) | set(y)):
            u, v = x.get(key), y.get(key)
            same = u == v or (isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v))
            compared += 1
            if not same:
                problems.append(f"step {step} {key}: {u!r} vs {v!r}")
    for line in problems:
        print(line)
    print(json.dumps({"identical": not problems, "steps": len(left["steps"]),
                      "values_compared": compared, "differences": len(problems)}))
    return 1 if problems else 0


@contextlib.contextmanager
def _server(url: str | None, model_path: str):
    if url:
        yield url
        return
    from grpo_agent.sampler.server import ManagedVLLMServer

    with ManagedVLLMServer(model_path, dtype="float32", weight_transfer_backend="gloo",
                           max_model_len=1024, enforce_eager=True) as server:
        yield server.base_url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("replay")
    rep.add_argument("--recording", type=Path, required=True)
    rep.add_argument("--out", type=Path, required=True)
    for p in (rec, rep):
        p.add_argument("--vllm-url", default=None, help="a server you started (weights get pushed)")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    opts = parser.parse_args()
    if opts.cmd == "compare":
        return compare(opts.a, opts.b)
    from grpo_agent.testing import build_tiny_model

    model_path = str(build_tiny_model())
    with _server(opts.vllm_url, model_path) as url:
        if opts.cmd == "record":
            record(opts.out, url, model_path)
        else:
            replay(opts.recording, opts.out, url, model_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
