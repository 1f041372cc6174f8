"""Evaluation scheduling in the real trainer, with scripted samples and a scripted evaluation
(no server): eval_on_start and every eval_steps, each evaluation pinned by holding the next
weight push until it ends, the stall measured, and pass@k computed as the unbiased estimate."""
from __future__ import annotations

import asyncio
import threading

import pytest
from datasets import Dataset
from grpo_agent.rollout.evaluation import EvalResult, EvalRow, eval_metrics, pass_at_k
from grpo_agent.train import evaluation

EVAL_S = 0.6  # each scripted evaluation takes this long


class RecordingEvalSession:
    """An evaluation session stand-in: records ("evaluate", version, adapter) in `events`."""

    def __init__(self, events: list, lora_name=None):
        self.events, self.lora_name = events, lora_name

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info): ...

    async def evaluate(self, rows, version):
        self.events.append(("evaluate", version, self.lora_name))
        row = EvalRow(0, ["x"], [1.0], [True])
        metrics = {**eval_metrics([row], [], 1, 0), "eval/model_version": float(version)}
        return EvalResult(version, metrics, [row], {str(version)}, 0.0)


class EvalPusher:
    """A pusher stand-in for `served_for_evaluate`: records push, wait and close in `events`."""

    def __init__(self, events: list, lora_name=None, trained=lambda model: False):
        self.events, self.lora_name, self.trained = events, lora_name, trained

    def needs_initial_push(self, model, holds_pushed_weights):
        return self.trained(model)

    def push(self, model, version):
        self.events.append(("push", version))
        return {}

    def wait(self):
        self.events.append(("wait",))
        return {}

    def close(self):
        self.events.append(("close",))


class Timeline:
    """What happened, in order: evaluations (start/end with version) and pushes."""

    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def add(self, *event):
        with self.lock:
            self.events.append(event)


@pytest.fixture
def scripted_eval(monkeypatch):
    """The trainer's evaluation session replaced by one that takes EVAL_S and records itself."""
    timeline = Timeline()

    class ScriptedSession:
        async def __aenter__(self):
            timeline.add("open")
            return self

        async def __aexit__(self, *exc_info):
            timeline.add("close")

        async def evaluate(self, rows, version):
            timeline.add("eval_start", version)
            await asyncio.sleep(EVAL_S)
            timeline.add("eval_end", version)
            row = EvalRow(0, ["x"], [1.0], [True], {"r": [1.0]})
            metrics = {**eval_metrics([row], [], 1, 0), "eval/model_version": float(version)}
            return EvalResult(version, metrics, [row], {str(version)}, EVAL_S)

    monkeypatch.setattr(evaluation.TrainingEvaluator, "session", lambda self: ScriptedSession())
    return timeline


class RecordingPush:
    lora_name = None

    def __init__(self, timeline):
        self.timeline = timeline

    def push(self, model, version):
        self.timeline.add("push", version)
        return {}

    def wait(self):
        return {}

    def close(self): ...


def run_trainer(tmp_path, timeline, steps, eval_dataset=None, callbacks=None, **config):
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.testing.offline import OfflineTrainer, ScriptedWorker

    from tests.train.test_step_read import TOKEN_BUDGET, group

    class Trainer(OfflineTrainer):
        def start_pipeline(self):
            self.token_budget = self.args.token_budget
            self.pusher = RecordingPush(timeline)
            self.source = self._step_source(ScriptedWorker(list(self.samples)))

    settings = {"output_dir": str(tmp_path), "max_steps": steps, "token_budget": TOKEN_BUDGET,
                "gradient_checkpointing": False, "optim": "adamw_torch", "report_to": "none",
                "save_strategy": "no", "disable_tqdm": True, "use_cpu": True}
    args = AsyncGRPOConfig(**{**settings, **config})
    trainer = Trainer(build_tiny_model(), args=args, reward_funcs=[],
                      train_dataset=Dataset.from_dict({"prompt": [[]] * 64}),
                      eval_dataset=eval_dataset, callbacks=callbacks)
    trainer.samples = [s for g in range(steps + 1) for s in group(g)]
    trainer.train()
    return trainer


def test_evals_start_after_pushes_and_hold_the_next_push_until_they_end(tmp_path, scripted_eval):
    trainer = run_trainer(
        tmp_path, scripted_eval, steps=4, eval_dataset=EVAL_SPLIT, eval_strategy="steps",
        eval_steps=2, eval_on_start=True, per_device_eval_batch_size=2)
    trainer_eval = trainer.evaluator
    assert trainer_eval is not None and len(trainer_eval.rows) == 2
    events = scripted_eval.events
    # eval_on_start evaluates version 0; then steps 2 and 4 (versions 2 and 4, after their push).
    assert [e for e in events if e[0] == "eval_start"] == [
        ("eval_start", 0), ("eval_start", 2), ("eval_start", 4)]
    # The pin: no push happens between an evaluation's start and its end.
    for start in (i for i, e in enumerate(events) if e[0] == "eval_start"):
        end = events.index(("eval_end", events[start][1]), start)
        assert not any(e[0] == "push" for e in events[start:end]), events
    # Each evaluation is logged once, with the step it started after.
    evals = [row for row in trainer.state.log_history if "eval/pass@1" in row]
    assert [(row["eval/step"], row["eval/model_version"]) for row in evals] == [
        (0.0, 0.0), (2.0, 2.0), (4.0, 4.0)]
    # Each evaluation's row carries the training epoch of the step it is logged at (prompts
    # over the dataset's 64), not transformers' steps over max_steps (step 1 of 4: 0.25).
    epochs = {row["step"]: row["epoch"] for row in trainer.state.log_history if "loss" in row}
    assert [(row["step"], row["epoch"]) for row in evals] == [
        (step, epochs[step]) for step in (1, 3, 4)]
    assert epochs[1] < 0.25
    # One session for the run: opened at the first evaluation, closed when training ends.
    assert events[0] == ("open",) and events[-1] == ("close",)
    assert [e for e in events if e[0] in ("open", "close")] == [("open",), ("close",)]
    # Logging an evaluation leaves every step's own training row in place.
    assert [row["step"] for row in trainer.state.log_history if "loss" in row] == [1, 2, 3, 4]
    # The stall is measured at the first push after each evaluation (steps 1 and 3), and is at
    # most one evaluation long (the steps ran meanwhile).
    waits = {log["step"]: log["perf/eval_push_wait_s"] for log in trainer.state.log_history
             if "perf/eval_push_wait_s" in log}
    assert set(waits) == {1, 3}
    assert all(0.0 <= w <= EVAL_S + 0.2 for w in waits.values()), waits


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    rows = [EvalRow(0, ["a", "b"], [1.0, 0.0], [True, False]),
            EvalRow(1, ["c", "d"], [0.0, None], [False, False])]
    metrics = eval_metrics(rows, [], 2, 0)
    assert metrics["eval/pass@1"] == pytest.approx(0.25)
    assert metrics["eval/pass@2"] == pytest.approx(0.5)
    assert metrics["eval/reward"] == pytest.approx(1 / 3)  # the unscored rollout is left out


def test_a_trainer_with_eval_on_but_no_split_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="no eval split: pass eval_dataset"):
        run_trainer(tmp_path, Timeline(), steps=1, eval_strategy="steps", eval_steps=1)


def test_the_no_split_refusal_names_both_settings_that_turn_evaluation_off():
    """It said "eval_strategy=IntervalStrategy.STEPS ... or set eval_strategy='no'", but with
    eval_on_start=True a run with eval_strategy='no' still evaluates, and is refused again."""
    from grpo_agent import AsyncGRPOConfig

    args = AsyncGRPOConfig(output_dir="unused", eval_strategy="no", eval_on_start=True)
    with pytest.raises(ValueError) as refused:
        evaluation.check_eval_args(args, None)
    message = str(refused.value)
    assert message.startswith("eval_strategy='no', eval_on_start=True but there is no eval split")
    assert "eval_strategy='no' and eval_on_start=False" in message
    args = AsyncGRPOConfig(output_dir="unused", eval_strategy="steps", eval_steps=1)
    with pytest.raises(ValueError, match=r"^eval_strategy='steps', eval_on_start=False but"):
        evaluation.check_eval_args(args, None)


def test_the_cli_refuses_an_env_without_an_eval_split_before_a_server_starts(tmp_path, capsys):
    """`grpo-agent train --env words --set eval_on_start=true` (words declares no eval split)
    started the managed server (or probed --vllm-url) and built the trainer before failing as
    "the run failed ... error.log" with advice for the Python API (pass eval_dataset=...)."""
    from grpo_agent.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["train", "--env", "words", "--set", "eval_on_start=true", "--output-dir", str(out),
              "--vllm-url", "http://127.0.0.1:9"])  # never contacted
    message = capsys.readouterr().err
    assert done.value.code == 1, message[-3000:]
    assert ("The env 'words-v1' declares no eval split, but the run evaluates (eval_strategy='no', "
            "eval_on_start=True)") in message, message
    assert "--set eval_strategy=no --set eval_on_start=false" in message, message
    assert "the run failed" not in message and not (out / "config.json").exists(), message


EVAL_SPLIT = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]] * 2})


def test_eval_strategy_epoch_evaluates_once_the_run_is_over(tmp_path, scripted_eval):
    trainer = run_trainer(tmp_path, scripted_eval, steps=2, eval_dataset=EVAL_SPLIT,
                          eval_strategy="epoch")
    assert [e for e in scripted_eval.events if e[0] == "eval_start"] == [("eval_start", 2)]
    assert [row["eval/step"] for row in trainer.state.log_history if "eval/pass@1" in row] == [2.0]


def test_an_eval_dataset_dict_is_refused_with_what_to_pass():
    from grpo_agent.rollout.evaluation import dataset_rows

    with pytest.raises(TypeError, match="evaluation takes one split"):
        dataset_rows({"a": EVAL_SPLIT, "b": EVAL_SPLIT})
    with pytest.raises(ValueError, match="eval dataset is empty"):
        dataset_rows([])


def test_every_evaluation_is_logged_when_they_come_faster_than_the_pushes(tmp_path, scripted_eval):
    """eval_steps=1 under weight_sync_steps=2: an evaluation still running when the next one
    starts is awaited and logged, not dropped; the push is held only at push steps (2 and 4),
    and an evaluation started after a push waits for that push's successor, not the next step.
    Each is labelled with the step whose weights it evaluated: those of steps 1 and 3 evaluate
    the last push's (steps 0 and 2), and were labelled 1 and 3."""
    trainer = run_trainer(tmp_path, scripted_eval, steps=4, eval_dataset=EVAL_SPLIT,
                          eval_strategy="steps", eval_steps=1, weight_sync_steps=2)
    evals = [(row["eval/step"], row["eval/model_version"])
             for row in trainer.state.log_history if "eval/pass@1" in row]
    assert evals == [(0.0, 0.0), (2.0, 1.0), (2.0, 1.0), (4.0, 2.0)]
    waits = [log["step"] for log in trainer.state.log_history if "perf/eval_push_wait_s" in log]
    assert waits == [2, 4]


def test_the_last_evaluation_and_evaluate_after_train_score_the_last_steps_weights(
        tmp_path, scripted_eval):
    """3 steps under weight_sync_steps=2: step 3's weights were never pushed, so the run's last
    evaluation (eval_steps=3) and trainer.evaluate() after train() scored version 1 (step 2's
    weights) as eval/step 3. The last step now pushes; an evaluation still running from step 2
    holds that push as it holds any."""
    trainer = run_trainer(tmp_path, scripted_eval, steps=3, eval_dataset=EVAL_SPLIT,
                          eval_strategy="steps", eval_steps=2, weight_sync_steps=2)
    trainer.evaluate()
    events = [e for e in scripted_eval.events if e[0] in ("push", "eval_start", "eval_end")]
    assert events == [("push", 1), ("eval_start", 1), ("eval_end", 1), ("push", 2),
                      ("eval_start", 2), ("eval_end", 2), ("eval_start", 2), ("eval_end", 2)]
    evals = [(row["eval/step"], row["eval/model_version"])
             for row in trainer.state.log_history if "eval/pass@1" in row]
    assert evals == [(2.0, 1.0), (3.0, 2.0), (3.0, 2.0)]


def test_a_failed_evaluation_stops_the_run_naming_its_step(tmp_path, monkeypatch):
    class FailingSession:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info): ...

        async def evaluate(self, rows, version):
            raise ConnectionError("server gone")

    monkeypatch.setattr(evaluation.TrainingEvaluator, "session", lambda self: FailingSession())
    with pytest.raises(RuntimeError, match="The evaluation of step 2 failed: server gone"):
        run_trainer(tmp_path, Timeline(), steps=4, eval_dataset=EVAL_SPLIT,
                    eval_strategy="steps", eval_steps=2)


def test_an_evaluation_the_server_restore_interrupted_is_said_and_the_run_goes_on(
        tmp_path, monkeypatch, caplog):
    """A server lost or restored during an evaluation (`EvaluationInterrupted`) stopped the run,
    though training survives the restore: now that evaluation is dropped with a warning that
    names the step and the restart, and the next one is logged as usual."""
    import logging

    from grpo_agent.rollout.evaluation import EvaluationInterrupted

    class RestoredDuringStep2:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info): ...

        async def evaluate(self, rows, version):
            if version == 2:
                raise EvaluationInterrupted("The vLLM server at URL was restored during the "
                                            "evaluation of version 2.")
            row = EvalRow(0, ["x"], [1.0], [True])
            return EvalResult(version, eval_metrics([row], [], 1, 0), [row], {str(version)}, 0.0)

    monkeypatch.setattr(evaluation.TrainingEvaluator, "session", lambda self: RestoredDuringStep2())
    with caplog.at_level(logging.WARNING, logger="grpo_agent.train.evaluation"):
        trainer = run_trainer(tmp_path, Timeline(), steps=4, eval_dataset=EVAL_SPLIT,
                              eval_strategy="steps", eval_steps=2)
    evals = [row["eval/step"] for row in trainer.state.log_history if "eval/pass@1" in row]
    assert evals == [4.0]
    assert ("The evaluation of step 2 is dropped: The vLLM server at URL was restored during "
            "the evaluation of version 2. Training goes on.") in caplog.text


def test_the_last_evaluation_is_logged_before_the_report_to_integrations_close(tmp_path,
                                                                             scripted_eval):
    """`report_to` integrations close their run in on_train_end, which runs before the
    evaluation's callback: the evaluation after the last step is logged before that."""
    from transformers import TrainerCallback

    seen = []

    class Tracker(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(("log", logs.get("eval/step")))

        def on_train_end(self, args, state, control, **kwargs):
            seen.append(("train_end", None))

    run_trainer(tmp_path, scripted_eval, steps=2, eval_dataset=EVAL_SPLIT,
                eval_strategy="steps", eval_steps=2, callbacks=[Tracker()])
    assert ("log", 2.0) in seen
    assert seen.index(("log", 2.0)) < seen.index(("train_end", None))


def test_eval_on_start_alone_wants_a_split_and_best_model_settings_are_refused():
    from types import SimpleNamespace

    start_only = SimpleNamespace(eval_strategy="no", eval_on_start=True,
                                 metric_for_best_model=None, load_best_model_at_end=False)
    with pytest.raises(ValueError, match="no eval split: pass eval_dataset"):
        evaluation.check_eval_args(start_only, None)
    evaluation.check_eval_args(SimpleNamespace(**{**vars(start_only), "eval_on_start": False}), None)
    best = SimpleNamespace(**{**vars(start_only), "load_best_model_at_end": True})
    with pytest.raises(ValueError, match="load_best_model_at_end are not supported"):
        evaluation.check_eval_args(best, EVAL_SPLIT)


def test_an_evaluation_other_weights_answered_is_dropped_with_the_reason(tmp_path, monkeypatch,
                                                                        caplog):
    """The real eval session, its loop scripted: at step 2 the server answers with its own
    weights (labelled "default", a server restarted before the restore's push landed), and
    the restore count has not moved. That evaluation was scored (a broken pin only warned
    about); now it is dropped, saying why, and the run goes on."""
    import logging

    from grpo_agent.rollout import evaluation as rollout_evaluation
    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.rollout.versions import rollout_version
    from grpo_agent.sampler.server_facts import ServerFacts
    from grpo_agent.types import Rollout, TurnRecord

    class RestartedAtVersion2(AsyncRolloutLoop):
        async def generate_one(self, prompt, tools, group_id=0):
            label = "default" if rollout_version() == 2 else str(rollout_version())
            return Rollout(completion=[{"role": "assistant", "content": "x"}], completion_ids=[1],
                           turns=[TurnRecord([0], [1], weight_versions=[label])])

    async def probe(client, **kwargs):
        return ServerFacts(model_id="scripted", max_model_len=4096)

    def session(self):
        return EvalSession(RestartedAtVersion2, config=self.trainer.args, processing_class=None,
                           reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                           settings=EvalSettings(), restores=lambda: 0)

    monkeypatch.setattr(rollout_evaluation, "probe_server", probe)
    monkeypatch.setattr(evaluation.TrainingEvaluator, "session", session)
    with caplog.at_level(logging.WARNING, logger="grpo_agent.train.evaluation"):
        trainer = run_trainer(tmp_path, Timeline(), steps=4, eval_dataset=EVAL_SPLIT,
                              eval_strategy="steps", eval_steps=2)
    evals = [row["eval/step"] for row in trainer.state.log_history if "eval/pass@1" in row]
    assert evals == [4.0]
    assert ("The evaluation of step 2 is dropped: The vLLM server at http://localhost:8000 "
            "sampled the evaluation of version 2 with weights labelled ['default'], not ['2']"
            ) in caplog.text


def test_evaluate_raises_an_evaluation_it_cannot_score_saying_to_call_it_again(tmp_path,
                                                                            monkeypatch):
    """`trainer.evaluate()` blocks for metrics, so an evaluation it cannot score (here the real
    session finds the server's own "default" weights answering version 5) is raised, not
    dropped as during training; it raised the session's message alone, which tells a training
    run's next evaluation to take over. Now it says to call evaluate() again, and logs nothing."""
    from types import SimpleNamespace

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout import evaluation as rollout_evaluation
    from grpo_agent.rollout.evaluation import EvalSession, EvalSettings, EvaluationInterrupted
    from grpo_agent.rollout.loop import AsyncRolloutLoop
    from grpo_agent.sampler.server_facts import ServerFacts
    from grpo_agent.types import Rollout, TurnRecord

    class Restarted(AsyncRolloutLoop):
        async def generate_one(self, prompt, tools, group_id=0):
            return Rollout(completion=[{"role": "assistant", "content": "x"}], completion_ids=[1],
                           turns=[TurnRecord([0], [1], weight_versions=["default"])])

    async def probe(client, **kwargs):
        return ServerFacts(model_id="scripted", max_model_len=4096)

    def session(self):
        return EvalSession(Restarted, config=self.trainer.args, processing_class=None,
                           reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                           settings=EvalSettings(), restores=lambda: 0)

    monkeypatch.setattr(rollout_evaluation, "probe_server", probe)
    monkeypatch.setattr(evaluation.TrainingEvaluator, "session", session)
    logged = []
    trainer = SimpleNamespace(evaluator=None, pusher=None, synced_lora_name=None, model_version=5,
                              recheck_served=False, served_step=7, log=logged.append,
                              args=AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True,
                                                   report_to="none"),
                              state=SimpleNamespace(global_step=7))
    with pytest.raises(EvaluationInterrupted, match=(
            r"^The vLLM server at \S+ sampled the evaluation of version 5 with weights labelled "
            r"\['default'\], not \['5'\] .* trainer\.evaluate\(\) scored and logged nothing: "
            r"call it again once the server answers \(outside train\(\) it serves version 5's "
            r"weights first where the server lost them; during train\(\), from a later step: "
            r"the trainer restores a lost server and pushes its weights first\)\.$")):
        evaluation.evaluate_now(trainer, EVAL_SPLIT)
    assert logged == []


def test_evaluate_evaluates_the_split_it_is_given_and_records_the_step(tmp_path, monkeypatch):
    """`trainer.evaluate(split)` evaluates `split` (not the trainer's own), on the served
    version, and logs it with `eval/step`; without any split it says what to pass."""
    from types import SimpleNamespace

    from grpo_agent import AsyncGRPOConfig

    evaluated = []

    class CountingSession:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info): ...

        async def evaluate(self, rows, version):
            evaluated.append((len(rows), version))
            row = EvalRow(0, ["x"], [1.0], [True])
            return EvalResult(version, eval_metrics([row], [], 1, 0), [row], {str(version)}, 0.0)

    monkeypatch.setattr(evaluation.TrainingEvaluator, "session", lambda self: CountingSession())
    logged = []
    trainer = SimpleNamespace(evaluator=None, args=AsyncGRPOConfig(output_dir=str(tmp_path)),
                              pusher=None, synced_lora_name=None, recheck_served=False,
                              model_version=5,
                              served_step=6, state=SimpleNamespace(global_step=7),
                              log=logged.append)
    with pytest.raises(ValueError, match="evaluate\\(\\) needs an eval split"):
        evaluation.evaluate_now(trainer)
    trainer.evaluator = evaluation.TrainingEvaluator(trainer, EVAL_SPLIT, None)  # 2 rows
    three = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]] * 3})
    metrics = evaluation.evaluate_now(trainer, three)
    assert evaluated == [(3, 5)]
    assert metrics["eval/step"] == 6.0 and logged == [metrics]  # version 5 is step 6's weights
    evaluation.evaluate_now(trainer)
    assert evaluated == [(3, 5), (2, 5)]  # the trainer's own split


def test_evaluate_before_train_pushes_a_trained_adapter_passed_in_and_evaluates_it(
        tmp_path, monkeypatch):
    """`evaluate()` before `train()` with a trained PEFT adapter as the model evaluated version
    0, the base model a fresh server serves, under either sync. Now the weights are pushed as
    version 1 first (as train() does before its first rollout, by the pusher the server calls
    for) and the pusher closed after (an adapter unloaded); an untrained adapter (the base
    model itself) pushes nothing."""
    from types import SimpleNamespace

    import torch
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.train import setup
    from grpo_agent.train.weights import has_trained_adapter
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    events = []

    def pusher_factory(args, model, facts):
        events.append(("pusher for", facts))
        return EvalPusher(events, "run", trained=has_trained_adapter)

    monkeypatch.setattr(evaluation.TrainingEvaluator, "session",
                        lambda self, lora_name=None: RecordingEvalSession(events, lora_name))
    facts = SimpleNamespace(holds_pushed_weights=False)
    monkeypatch.setattr(setup, "check_server", lambda args, model: facts)
    base = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    logged = []
    trainer = SimpleNamespace(evaluator=None, pusher=None, synced_lora_name=None,
                              recheck_served=False, model_version=0,
                              served_step=0, model=model, pusher_factory=pusher_factory,
                              log=logged.append,
                              args=AsyncGRPOConfig(output_dir=str(tmp_path)),
                              state=SimpleNamespace(global_step=0))
    evaluation.evaluate_now(trainer, EVAL_SPLIT)
    # B is zero: the served base model is the policy (the pusher asked, and closed unused)
    assert events == [("pusher for", facts), ("close",), ("evaluate", 0, None)]
    events.clear()
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if ".lora_B." in n).fill_(0.1)
    metrics = evaluation.evaluate_now(trainer, EVAL_SPLIT)
    assert events == [("pusher for", facts), ("push", 1), ("wait",), ("evaluate", 1, "run"),
                      ("close",)]
    assert metrics["eval/model_version"] == 1.0 and metrics["eval/step"] == 0.0
    assert logged[-1] == metrics and trainer.model_version == 0  # train() pushes version 1 again


def test_evaluate_after_a_resume_that_trained_nothing_pushes_the_restored_weights(
        tmp_path, monkeypatch):
    """`train(resume_from_checkpoint=<the run's last step>)` loads the checkpoint and trains
    nothing, so nothing is pushed (`ends_the_run`; it sets `recheck_served`, see
    tests/train/test_final_save.py). Unless the server is labelled with the restored version,
    `evaluate()` pushes the weights as it first, by the pusher the server calls for; it must
    not sample whatever the server holds under that version's name."""
    from types import SimpleNamespace

    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.sampler.server_facts import ServerFacts
    from grpo_agent.train import setup

    events = []
    served = {"label": "default"}  # a fresh server's own weights, not version 5's
    monkeypatch.setattr(evaluation.TrainingEvaluator, "session",
                        lambda self, lora_name=None: RecordingEvalSession(events, lora_name))
    monkeypatch.setattr(setup, "check_server", lambda args, model: ServerFacts(
        "m", 4096, weight_version=served["label"]))
    trainer = SimpleNamespace(evaluator=None, pusher=None, synced_lora_name=None,
                              recheck_served=True, model_version=5, served_step=6,
                              model=object(),
                              pusher_factory=lambda args, model, facts: EvalPusher(events),
                              log=lambda metrics: None,
                              args=AsyncGRPOConfig(output_dir=str(tmp_path)),
                              state=SimpleNamespace(global_step=6))
    evaluation.evaluate_now(trainer, EVAL_SPLIT)
    assert events == [("push", 5), ("wait",), ("evaluate", 5, None), ("close",)]
    events.clear()
    served["label"] = "5"  # the server holds version 5 already
    evaluation.evaluate_now(trainer, EVAL_SPLIT)
    assert events == [("evaluate", 5, None)]


def test_the_start_evaluation_is_logged_when_the_run_stalls_before_its_first_step(
        tmp_path, scripted_eval):
    """eval_on_start's evaluation is logged at a step's end; a run whose groups were all
    dropped stopped at no_progress_timeout before any step ended, and its finished start
    evaluation never reached metrics.jsonl. The worker is scripted, the no-progress stop real."""
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.testing import build_tiny_model
    from grpo_agent.testing.offline import OfflineTrainer, ScriptedWorker
    from grpo_agent.train.no_progress import NO_PROGRESS_WINDOW_GROUPS, NoProgressStalled
    from grpo_agent.train.reporting import METRICS_NAME, JsonlMetricsCallback, read_metrics
    from grpo_agent.types import PromptConsumed

    from tests.train.test_step_read import TOKEN_BUDGET

    class AllDropped(OfflineTrainer):
        def start_pipeline(self):
            self.token_budget = self.args.token_budget
            self.pusher = RecordingPush(scripted_eval)
            dropped = [PromptConsumed(i, i, "zero_std") for i in range(NO_PROGRESS_WINDOW_GROUPS)]
            self.source = self._step_source(ScriptedWorker(dropped))

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=2, token_budget=TOKEN_BUDGET,
        gradient_checkpointing=False, optim="adamw_torch", report_to="none", save_strategy="no",
        disable_tqdm=True, use_cpu=True, eval_on_start=True, per_device_eval_batch_size=2,
        no_progress_timeout=EVAL_S + 1.0)
    trainer = AllDropped(build_tiny_model(), args=args, reward_funcs=[],
                         train_dataset=Dataset.from_dict({"prompt": [[]] * 64}),
                         eval_dataset=EVAL_SPLIT, callbacks=[JsonlMetricsCallback()])
    trainer.samples = []
    with pytest.raises(NoProgressStalled):
        trainer.train()
    assert trainer.state.global_step == 0
    evals = [row for row in read_metrics(tmp_path / METRICS_NAME) if "eval/pass@1" in row]
    assert [(row["eval/step"], row["eval/model_version"]) for row in evals] == [(0.0, 0.0)]
    assert scripted_eval.events[-1] == ("close",)  # the evaluation session was closed too
