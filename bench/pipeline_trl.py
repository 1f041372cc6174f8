"""Issue 21's task on TRL 1.16.0's AsyncGRPOTrainer: the baseline `bench/pipeline.py` is judged by.

Same task, model, server recipe and measurement as `bench/pipeline.py` (its functions are
imported, not copied): 256 prompts, the digit-share reward, the tiny random Qwen3, 8
generations, `max_completion_length=64`, `token_budget=2120` with one micro-batch per step,
`learning_rate=1e-4`, `max_staleness=4`, a push every step, fp32 on one torch thread, a managed
bf16 vLLM CPU server with the issue's flags (or `--base-url/--server-pid`). Per step it records
the wall time between two logged steps and TRL's own `batch/trained_tokens_per_step` (its
trained, i.e. loss-masked completion, tokens: the count ours logs under the same name), so
trained tokens/s means the same on both sides. `per_device_train_batch_size=32` only sizes TRL's
in-flight requests (`max_staleness` x 32 = 128, as in the issue's run); the token budget makes
the step.

TRL is installed apart from .venv (`make bench-trl-venv`: `pip install --target .bench-trl
--no-deps trl==1.16.0`; every other dependency it imports is already in .venv). What it needs
to run on this CPU box (tree attention on our CPU kernel, gloo in place of NCCL for the push,
unseeded requests, a response template for the tiny model's chat template) is in
`bench/trl_cpu.py`, each part with its reason.

After the run each step's collated row is forwarded and backpropagated again alone (TRL's own
`compute_loss`), so `fwd_bwd_inflation` is comparable with ours.

    make bench-trl-venv && python bench/pipeline_trl.py [--steps 30] [--warmup 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pipeline import TOKEN_BUDGET, add_run_args, digit_fraction, summary, task_dataset, task_server
from step_record import StepTimers, make_recorder

TRL_DIR = Path(__file__).resolve().parent.parent / ".bench-trl"
TRL_VERSION = "1.16.0"


def import_trl():
    """TRL from .bench-trl (never .venv's site-packages), with a clear error when absent."""
    sys.path.insert(0, str(TRL_DIR))
    try:
        import trl
    except ImportError as error:
        raise SystemExit(f"TRL is not installed in {TRL_DIR} ({error}); run `make bench-trl-venv`.") from error
    if trl.__version__ != TRL_VERSION or not trl.__file__.startswith(str(TRL_DIR)):
        raise SystemExit(f"found trl {trl.__version__} at {trl.__file__}, want {TRL_VERSION} from {TRL_DIR}; "
                         "run `make bench-trl-venv`.")
    return trl


def isolated_fwd_bwd(trainer, rows: list) -> list[float]:
    """Each step's collated row through TRL's compute_loss + backward again, alone (min of 2
    after a warm-up), as `bench/pipeline.py` does for ours."""
    times = []
    for inputs in rows:
        best = float("inf")
        for repeat in range(3 if not times else 2):
            started = time.perf_counter()
            trainer.compute_loss(trainer.model, inputs).backward()
            elapsed = time.perf_counter() - started
            trainer.model.zero_grad(set_to_none=True)
            if times or repeat > 0:
                best = min(best, elapsed)
        times.append(best)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser)
    opts = parser.parse_args()
    import_trl()
    import torch
    import trl_cpu
    from grpo_agent.testing import build_tiny_model
    from trl.experimental.async_grpo import (
        AsyncGRPOConfig,
        AsyncGRPOTrainer,
        async_grpo_trainer,
        packing,
    )
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    torch.set_num_threads(1)  # what ours picks beside a local server on this 2-core box
    trl_cpu.cpu_tree_attention(packing)
    trl_cpu.no_peak_flops(async_grpo_trainer)
    model_path = str(build_tiny_model())
    timers, rows, records = StepTimers(), [], []
    timers.wrap(DataCollatorForRollout, "torch_call", "packing_plan")
    timers.wrap(AsyncGRPOTrainer, "log", "metrics")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, task_server(opts, model_path) as server:
        args = AsyncGRPOConfig(
            output_dir=tmp, vllm_server_base_url=server.base_url, max_steps=opts.steps,
            num_generations=8, max_completion_length=64, token_budget=TOKEN_BUDGET,
            per_device_train_batch_size=32, gradient_accumulation_steps=1, learning_rate=1e-4,
            max_staleness=4, weight_sync_steps=1, dtype="float32", bf16=False,
            gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
            disable_tqdm=True, use_cpu=True)
        transfer = trl_cpu.GlooWeightTransfer(
            VLLMClient(server.base_url, args.vllm_server_timeout), {}, args.weight_sync_timeout)
        trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=digit_fraction,
                                   train_dataset=task_dataset(), args=args, weight_transfer=transfer,
                                   processing_class=trl_cpu.qwen3_tokenizer(model_path))
        trainer.rollout_worker._loop_cls = trl_cpu.UnseededRolloutLoop
        original_step = trainer.training_step

        def keep_row(model, inputs, num_items_in_batch=None):
            rows.append(inputs)
            return original_step(model, inputs, num_items_in_batch)

        trainer.training_step = keep_row
        trainer.add_callback(make_recorder(lambda: trainer.rollout_worker._process.pid, server, timers,
                                           records, server.base_url))
        started = time.perf_counter()
        trainer.train()
        run_s = time.perf_counter() - started
        timers.restore()
        isolated = isolated_fwd_bwd(trainer, rows)
    load_after = os.getloadavg()
    measured = records[opts.warmup:]
    print(json.dumps({**summary(measured, isolated[opts.warmup:], run_s, load_before, load_after),
                      "trainer": f"trl {TRL_VERSION}"}))


if __name__ == "__main__":
    main()
