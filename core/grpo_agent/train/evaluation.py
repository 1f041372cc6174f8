"""Evaluation during training: started right after a weight push, finished before the next.

Design decision: an evaluation runs in a background thread of the main process (its own event
loop and HTTP client against the same vLLM server, opened once per run), so training steps go
on while it runs. It
is pinned to the version it started on by holding the *next* weight push until it has ended:
the trainer stalls only when an evaluation outlasts the steps until that push, and the stall
is measured (`perf/eval_push_wait_s`). With LoRA adapter sync, each request names the
version's adapter as well. Nothing of the training side is touched: the rollout worker, its
prompt stream, the staleness window and the prompt ledger never see an eval row.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from transformers import TrainerCallback

from grpo_agent.rollout.evaluation import (
    EvalResult,
    EvalSession,
    EvalSettings,
    EvaluationInterrupted,
    run_evaluation,
)


class TrainerView(Protocol):
    """What evaluation reads of the trainer (the trainer imports this module, not the reverse):
    the run's config and rollout parts for the eval session, and its log, step state, metric
    window and evaluator for scheduling and logging."""

    args: Any
    loop_cls: type
    processing_class: Any
    reward_funcs: Any
    tools: Any
    environment_factory: Any
    pusher: Any
    pusher_factory: Callable[..., Any]
    synced_lora_name: str | None
    recheck_served: bool
    model: Any
    model_version: int
    served_step: int
    state: Any
    control: Any
    window: Any
    evaluator: TrainingEvaluator | None

    def log(self, logs: dict[str, float], *args: Any) -> None: ...

    def settle_push(self) -> None:
        """Until the server serves `model_version` (a push may still be sending)."""

    def step_pushes(self, step: int, *, recorded: bool = True) -> bool:
        """Whether `step` ends with a weight push (every `weight_sync_steps`, and the last)."""

    def server_restores(self) -> int:
        """How many times the run has restored its server (the session re-reads it after one)."""

logger = logging.getLogger(__name__)


def wants_evaluation(args: Any) -> bool:
    return _strategy(args) != "no" or bool(args.eval_on_start)


def _strategy(args: Any) -> str:
    """eval_strategy as the user writes it (transformers may hold it as an enum)."""
    return str(getattr(args.eval_strategy, "value", args.eval_strategy))


def evaluation_settings(args: Any) -> str:
    """The settings that ask for evaluation, as the user writes them."""
    return f"eval_strategy={_strategy(args)!r}, eval_on_start={bool(args.eval_on_start)}"


def eval_split_of(environment_factory: Any) -> tuple[Any, float | None]:
    """A registered env's eval split and success threshold (a name or `load_environment` spec)."""
    from grpo_agent.plugins.registry import EnvironmentSpec

    spec = environment_factory
    if isinstance(spec, str):
        from grpo_agent.plugins import load_registry

        spec = load_registry().environment_spec(spec)
    if not isinstance(spec, EnvironmentSpec):
        return None, None
    return spec.load_eval_dataset(), getattr(spec, "success_threshold", None)


def check_eval_args(args: Any, eval_dataset: Any) -> None:
    """Refuse what cannot work with an evaluation that reports after the step that started it."""
    if not wants_evaluation(args):
        return
    if eval_dataset is None:
        raise ValueError(
            f"{evaluation_settings(args)} but there is no eval split: pass eval_dataset=... to "
            "AsyncGRPOTrainer, use an environment that declares one (@environment(eval_dataset="
            "...)), or turn evaluation off: eval_strategy='no' and eval_on_start=False.")
    if args.metric_for_best_model is not None or args.load_best_model_at_end:
        raise ValueError(
            "metric_for_best_model / load_best_model_at_end are not supported: evaluations run "
            "beside training and report after the step that started them, so no checkpoint can "
            "be chosen by them at save time. Remove them; eval/* is in the logs.")


class _SessionThread:
    """An event loop in a daemon thread holding one open `EvalSession` across a run's
    evaluations: the server probe, the loop's construction and `setup` are paid once, not at
    every evaluation (where they would lengthen the push wait)."""

    def __init__(self, factory: Callable[[], EvalSession]) -> None:
        self._factory = factory
        self._session: EvalSession | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpo-agent-eval",
                                        daemon=True)
        self._thread.start()

    def submit(self, rows: list[dict], version: int) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._evaluate(rows, version), self._loop)

    async def _evaluate(self, rows: list[dict], version: int) -> EvalResult:
        if self._session is None:
            session = self._factory()
            await session.__aenter__()
            self._session = session
        return await self._session.evaluate(rows, version)

    def close(self) -> None:
        try:
            if self._session is not None:
                closing = self._session.__aexit__(None, None, None)
                asyncio.run_coroutine_threadsafe(closing, self._loop).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()


class TrainingEvaluator:
    """One evaluation at a time, beside training; the trainer logs finished ones."""

    def __init__(self, trainer: TrainerView, eval_dataset: Any, env_threshold: float | None) -> None:
        from grpo_agent.rollout.evaluation import dataset_rows

        self.trainer = trainer
        self.rows = dataset_rows(eval_dataset)
        self.settings = EvalSettings.from_config(trainer.args, env_threshold)
        self._runner: _SessionThread | None = None  # opened at the first evaluation of a run
        self._future: concurrent.futures.Future | None = None
        self._result: EvalResult | None = None
        self._error: BaseException | None = None
        self._step = 0
        self.before_next_push = False  # an evaluation started since the last push
        self.results: list[EvalResult] = []  # every finished evaluation of this trainer

    def session(self, lora_name: str | None = None) -> EvalSession:
        """`lora_name`: the adapter prefix to sample; default the running pipeline's pusher's."""
        from grpo_agent.train.setup import server_needs

        trainer = self.trainer
        needs = server_needs(trainer.args, trainer.model, lora_sync=False)  # its dtype, as training's
        return EvalSession(
            trainer.loop_cls, config=trainer.args, processing_class=trainer.processing_class,
            reward_funcs=trainer.reward_funcs, settings=self.settings, tools=trainer.tools,
            environment_factory=trainer.environment_factory,
            lora_name=lora_name or getattr(trainer.pusher, "lora_name", None),
            model_name=str(trainer.model.config._name_or_path),
            restores=getattr(trainer, "server_restores", None),  # None: a stand-in trainer
            dtype=needs.trainer_dtype, bf16_only_on_cpu=needs.bf16_only_on_cpu)

    @property
    def running(self) -> bool:
        return self._future is not None

    def start(self, version: int, step: int) -> None:
        """Evaluate `version` (the one on the server now) in the background."""
        self.wait()  # one at a time: a new one waits for the last (it pins an older version)
        self._step, self._result, self._error = step, None, None
        self.before_next_push = True
        if self._runner is None:
            self._runner = _SessionThread(self.session)
        self._future = self._runner.submit(self.rows, version)

    def wait(self) -> float:
        """Block until the running evaluation ends (if any); returns the seconds waited."""
        if self._future is None:
            return 0.0
        started = time.perf_counter()
        try:
            self._result = self._future.result()
        except BaseException as error:  # noqa: BLE001 - raised by take_finished, with the step
            self._error = error
        self._future = None
        return time.perf_counter() - started

    def close(self) -> None:
        """Wait for the running evaluation, then close the session (at the end of `train`)."""
        self.wait()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            runner.close()

    def take_finished(self) -> dict[str, float] | None:
        """The last finished evaluation's metrics (once), or None; raises its error, but one
        not scored (`EvaluationInterrupted`: the server restored or lost during it, or other
        weights served) is only said: the run survives the restore."""
        if self._future is not None and self._future.done():
            self.wait()
        if self._future is not None:
            return None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, EvaluationInterrupted):
                logger.warning("The evaluation of step %d is dropped: %s Training goes on.",
                               self._step, error)
                return None
            raise RuntimeError(f"The evaluation of step {self._step} failed: {error}") from error
        if self._result is None:
            return None
        result, self._result = self._result, None
        self.results.append(result)
        return {**result.metrics, "eval/step": float(self._step)}

    def log_finished(self) -> None:
        """Log the evaluation that finished, if any. During training, only once the step's
        epoch is counted (`end_step`): the row carries the trainer's epoch, and before that it
        is transformers' own (steps over `max_steps`: 0.5 where the step's row says 0.06)."""
        if (metrics := self.take_finished()) is None:
            return
        control = self.trainer.control
        should_log = control.should_log  # logging resets it: the step's own row must follow
        self.trainer.log(metrics)
        control.should_log = should_log


    def log_at_stop(self) -> None:
        """A run stopped by an error or an interrupt logs the evaluation that finished: step
        ends log them, so eval_on_start's was lost when the run stalled before its first step.
        One still running is not awaited (the stop would wait for it), and an evaluation's own
        error is only said: the run's error is the one raised."""
        if self._future is not None and not self._future.done():
            return
        try:
            self.close()
            self.log_finished()
        except Exception as error:  # noqa: BLE001 - never hides the error that stopped the run
            logger.warning("The evaluation that finished before the run stopped is not logged: %s",
                           error)


class EvaluationCallback(TrainerCallback):
    """Holds a step's weight push until the running evaluation ends; logs the last one at the end.

    Registered before the step callback that pushes, so its `on_step_end` runs first. The step's
    `end_step` logs what finished (`TrainingEvaluator.log_finished`), once it counted the epoch."""

    def __init__(self, trainer: TrainerView) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        evaluator = self.trainer.evaluator
        if evaluator is None:
            return
        pushes = self.trainer.step_pushes(state.global_step, recorded=False)
        if pushes and evaluator.before_next_push:
            waited = evaluator.wait()  # the stall: this step's push waits for the evaluation
            evaluator.before_next_push = False
            self.trainer.window.add("perf/eval_push_wait_s", waited)
            if waited > 0.01:
                logger.info("Weight push of step %d waited %.2f s for the evaluation.",
                            state.global_step, waited)

    def on_train_end(self, args, state, control, **kwargs):
        evaluator = self.trainer.evaluator
        if evaluator is not None:
            evaluator.close()
            evaluator.log_finished()


def start_training_eval(trainer: TrainerView) -> dict[str, float]:
    """The Trainer's `_evaluate` hook during `train()`: start one in the background (main
    process only; metrics are logged when it ends, as `eval/*` with `eval/step`)."""
    from grpo_agent.train import fsdp

    if trainer.evaluator is not None:
        trainer.settle_push()  # every rank: the version evaluated is the one served
    if trainer.evaluator is not None and fsdp.is_main_process():
        # One at a time: one still running (no push came between, weight_sync_steps > 1) ends
        # first and is logged now; `start` would drop its result (or its error) otherwise.
        trainer.evaluator.wait()
        trainer.evaluator.log_finished()
        trainer.evaluator.start(trainer.model_version, trainer.served_step)
        if trainer.control.should_training_stop:
            # The run's last one is awaited and logged now: `report_to` integrations close their
            # run in on_train_end (trackio's later logs are lost), which runs before ours.
            trainer.evaluator.wait()
            trainer.evaluator.log_finished()
    trainer.control.should_evaluate = False  # Trainer.evaluate's on_evaluate would reset it
    return {}


def evaluate_now(trainer: TrainerView, eval_dataset: Any = None) -> dict[str, float]:
    """`trainer.evaluate()`: one blocking evaluation of the trainer's weights, served first where
    the server may not hold them (`served_for_evaluate`), logged and returned. One it cannot score raises `EvaluationInterrupted` (a caller waiting for metrics gets none
    to log), with what to do added: call again."""
    from grpo_agent.rollout.evaluation import dataset_rows

    evaluator = trainer.evaluator
    if evaluator is None and eval_dataset is None:
        raise ValueError("evaluate() needs an eval split: pass eval_dataset to AsyncGRPOTrainer "
                         "or to evaluate().")
    if evaluator is None:
        evaluator = TrainingEvaluator(trainer, eval_dataset, None)
    evaluator.wait()
    if trainer.pusher is not None:  # during train(): the pipeline runs
        trainer.settle_push()
    rows = dataset_rows(eval_dataset) if eval_dataset is not None else evaluator.rows
    version = trainer.model_version
    try:
        with served_for_evaluate(trainer, version) as (lora_name, version):
            session = (evaluator.session if lora_name is None
                       else functools.partial(evaluator.session, lora_name))
            result = run_evaluation(session, rows, version)
    except EvaluationInterrupted as error:
        raise EvaluationInterrupted(
            f"{error} trainer.evaluate() scored and logged nothing: call it again once the server "
            f"answers (outside train() it serves version {version}'s weights first where the "
            "server lost them; during train(), from a later step: the trainer restores a lost "
            "server and pushes its weights first).") from error
    evaluator.results.append(result)
    metrics = {**result.metrics, "eval/step": float(trainer.served_step)}
    trainer.log(metrics)
    return metrics


@contextlib.contextmanager
def served_for_evaluate(trainer: TrainerView, version: int) -> Iterator[tuple[str | None, int]]:
    """The trainer's weights served for `trainer.evaluate()`; yields the adapter prefix to
    sample (None: the served model itself) and the version they are served as. During
    `train()` the pipeline serves them (`version`). Outside it the server may not:
    - after `train()` under LoRA adapter sync the run's end unloaded its adapters
      (`AdapterPusher.close`), so the evaluation would sample the base model: the trainer's
      adapter is loaded again as `version`'s and unloaded after;
    - after `train()` under merged sync the server serves `version` unless it was restarted
      (its start label) or another run pushed into it since (another version's label): then
      the weights are pushed again as `version` (a server without labels cannot tell, and
      the evaluation's label check cannot either: nothing is pushed);
    - after a `train()` that resumed from the run's last step and trained nothing
      (`ends_the_run`: nothing pushed) likewise: unless the server is labelled with `version`,
      the weights are pushed as it;
    - before `train()` (version 0) the server serves the model's weights only where `train()`
      would not push them before its first rollout (the pusher's `needs_initial_push`: not
      with a trained LoRA adapter passed in, nor on a server an earlier run pushed into, where
      calling again would meet the same weights, nor for a model not known to be the served
      checkpoint's): else they are pushed as version 1 first, by
      the pusher the server calls for (adapter sync on a LoRA server, else merged); an adapter
      is unloaded after, merged weights stay served.
    Every rank takes part, as in a push."""
    from grpo_agent.sampler.server_facts import served_version_labels
    from grpo_agent.train import fsdp, setup
    from grpo_agent.weight_sync.adapter import AdapterPusher

    if trainer.pusher is None and trainer.synced_lora_name is not None and version > 0:
        pusher = AdapterPusher(trainer.args, trainer.model, base_is_stale=False)
    elif trainer.pusher is None and trainer.recheck_served and version > 0:
        facts = setup.check_server(trainer.args, trainer.model)
        if facts.weight_version in {None, *served_version_labels(version)}:
            yield None, version
            return
        pusher = trainer.pusher_factory(trainer.args, trainer.model, facts)
    elif trainer.pusher is None and version == 0:
        facts = setup.check_server(trainer.args, trainer.model)
        pusher = trainer.pusher_factory(trainer.args, trainer.model, facts)
        if not pusher.needs_initial_push(trainer.model, facts.holds_pushed_weights):
            pusher.close()
            yield None, version
            return
        version = 1
    else:
        yield None, version
        return
    try:
        pusher.push(trainer.model, version)
        pusher.wait()  # a merged push may still be sending
        yield pusher.lora_name, version
    finally:
        if fsdp.world_size() > 1:
            torch.distributed.barrier()  # every rank's evaluation ended before the unload
        pusher.close()


def resolve_eval_split(eval_dataset: Any, environment_factory: Any, args: Any) -> tuple[Any, float | None]:
    """The eval split (given, else the env's declared one when evaluation is on) and the env's
    success threshold; refuses settings that cannot work (see `check_eval_args`)."""
    env_split, threshold = None, None
    if environment_factory is not None and not isinstance(environment_factory, dict):
        if eval_dataset is None and wants_evaluation(args):
            env_split, threshold = eval_split_of(environment_factory)
        else:
            threshold = _declared_threshold(environment_factory)
    eval_dataset = eval_dataset if eval_dataset is not None else env_split
    check_eval_args(args, eval_dataset)
    return eval_dataset, threshold


def _declared_threshold(environment_factory: Any) -> float | None:
    return getattr(environment_factory, "success_threshold", None)
