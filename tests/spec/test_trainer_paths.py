"""Trainer paths the spec's examples leave at their defaults, run through `AsyncGRPOTrainer`
against the real server: `weight_sync_steps`, `gradient_accumulation_steps` and `logging_steps`
above 1, and `log_completions`.

One run of 4 steps checks each logged window against the spec's rule (lines 154-159), applied
to the raw observations the window received: rates are total amount over total seconds, the
word `count` sums, `max`/`min` keep the extreme, anything else is the mean.
"""
from __future__ import annotations

import math

import pytest
from datasets import Dataset
from spec_harness import record_run, served_weight_version, spec_args, spec_reduce

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_windows_accumulation_sparse_syncs_and_logged_completions(spec_server, tmp_path, capsys,
                                                                  monkeypatch):
    from grpo_agent import AsyncGRPOTrainer
    from spec_examples.reward_length import reward_func

    monkeypatch.setenv("COLUMNS", "2000")  # rich prints each completion on one line
    # Rows longer than token_budget: their samples are dropped and counted (a `count` metric).
    too_long = ["The sky is blue because " * 30, "The sun is hot because " * 30]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in (
        "The sky is", "The sun is", *too_long)]})
    trainer = AsyncGRPOTrainer(
        model=str(spec_server.model_path), reward_funcs=reward_func, train_dataset=dataset,
        args=spec_args(spec_server, tmp_path, max_steps=4, logging_steps=2, token_budget=128,
                       gradient_accumulation_steps=2, weight_sync_steps=2,
                       log_completions=True, num_completions_to_print=2),
    )
    run = record_run(trainer)

    # logging_steps=2: one window per two optimizer steps, each reduced by the spec's rule.
    assert [entry["step"] for entry in run.logs] == [2, 4]
    assert len(run.windows) == 2
    kinds = set()
    for logged, window in zip(run.logs, run.windows):
        by_name: dict[str, list] = {}
        for name, value in window:
            by_name.setdefault(name, []).append(value)
        for name, values in by_name.items():
            expected = spec_reduce(name, values)
            if name.startswith("perf/") and math.isnan(expected):
                assert name not in logged  # unmeasured on this device (e.g. MFU on CPU)
                continue
            if name.endswith("_per_s"):
                assert all(isinstance(v, tuple) for v in values), name  # recorded as a rate
            assert logged[name] == pytest.approx(expected, nan_ok=True), name
            if _rules_disagree(values):
                kinds.add("rate" if isinstance(values[0], tuple) else _rule(name))
    assert kinds == {"rate", "sum", "max", "min", "mean"}  # every rule was put to the test

    # gradient_accumulation_steps=2: each step is two micro-batches (rows), each with a loss.
    assert run.values("batch/microbatches_per_step") == [2.0] * 4
    assert run.substeps == 4  # the Trainer's accumulation: one non-final micro-batch per step
    assert run.logs[-1]["num_tokens"] == sum(run.values("batch/forwarded_tokens_per_step"))

    # weight_sync_steps=2: the policy is pushed after steps 2 and 4 only.
    first = run.versions[0]
    assert run.versions == [first, first + 1, first + 1, first + 2]
    assert served_weight_version(spec_server.base_url) == str(trainer.model_version)

    # log_completions: the last step's samples, every logging_steps, at most 2 of them.
    out = capsys.readouterr().out
    assert [step for step in range(1, 5) if f"completions at step {step}" in out] == [2, 4]
    for step in (2, 4):
        table = out.split(f"completions at step {step}")[1].split("completions at step")[0]
        samples = run.step_samples[step - 1][:2]
        assert samples and all(f"{s.advantage:+.3f}" in table for s in samples)


def _rules_disagree(values: list) -> bool:
    """Whether the window's observations tell the rules apart (a sum from a mean, a total
    rate from a mean of rates, an extreme from a mean)."""
    if isinstance(values[0], tuple):
        rates = [amount / seconds for amount, seconds in values if seconds > 0]
        if len(rates) < 2:
            return False
        total = sum(a for a, _ in values) / sum(s for _, s in values)
        return not math.isclose(total, sum(rates) / len(rates))
    finite = [v for v in values if not math.isnan(v)]
    return len(finite) > 1 and len({sum(finite), max(finite), min(finite)}) > 1


def _rule(name: str) -> str:
    words = name.rsplit("/", 1)[-1].split("_")
    return next((rule for word, rule in (("count", "sum"), ("max", "max"), ("min", "min"))
                 if word in words), "mean")
