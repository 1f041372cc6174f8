"""`HarnessRolloutLoop`: rollouts are agent programs that call the policy through the gateway.

Design decision: only the rollout itself changes. The loop starts a `Gateway` in `setup`, and
each rollout opens a session (its own key, pinned to its group's model version), runs the
agent, and turns the session's recorded calls into a `Rollout` whose `turns` go through the
same fork reconciliation, scoring, staleness and packing as the built-in tool loop. An agent
that fails, or that never calls the model, gives a rollout with no turns (no samples) and a
NaN reward, counted in `harness/errors_count` or `harness/timeout_count`. A run during which
the server was lost is no run of the policy: it raises as a tool loop's request would
(`ServerUnreachableError`), so the worker drops its group as `server_lost` and asks for a
restore, and an evaluation is interrupted, instead of a failed agent run counted against it.
A call the server refused for the run's LoRA adapter is handled as the tool loop's request is
(`_raise_if_server_lost`): a restarted server is lost, any other refusal stops the run.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os

import numpy as np

from grpo_agent.metrics import Observation
from grpo_agent.rollout import unfinished
from grpo_agent.rollout.agent_programs import (
    AgentCommand,
    AgentFailure,
    resolve_agent,
    run_agent,
    shared_http_client,
)
from grpo_agent.rollout.gateway import AgentSession, Gateway, HarnessLimits
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.versions import rollout_version
from grpo_agent.sampler.errors import SamplerError, ServerUnreachableError
from grpo_agent.sampler.recovery import means_server_lost, restate_adapter_refusal
from grpo_agent.types import Rollout

logger = logging.getLogger(__name__)
FAILED_METRIC = "harness/dropped_frac"


def no_reply_failure(agent, session: AgentSession) -> AgentFailure:
    """The failure of a run that ended without one answered model call. When the gateway
    refused its calls (a wrong model name the agent caught, say), "never called the model"
    would send the user looking in the wrong place: name the refusal instead."""
    if session.rejected_calls:
        return AgentFailure("error", f"The agent returned without one answered model call: the "
                            f"gateway refused its {session.rejected_calls} call(s), the last with "
                            f"{session.last_rejection}")
    where = ("OPENAI_BASE_URL with the key in OPENAI_API_KEY" if isinstance(agent, AgentCommand)
             else "the client it is given")
    return AgentFailure("error", "The agent returned without calling the model; an agent must "
                        f"talk to the policy through {where}.")


class HarnessRolloutLoop(AsyncRolloutLoop):
    """The rollout loop of `HarnessAsyncGRPOTrainer` (built with `functools.partial` so the
    agent reference and limits travel to the spawned worker)."""

    reports_tools = True
    runs_tools = False  # the agent runs its tools: calls are parsed here, their outcomes are not
    # What blocks this loop when the worker stops beating (RolloutWorker's hung error).
    hang_suspects = ("an async agent that blocks the worker's event loop (a sync openai.OpenAI "
                     "client or time.sleep in it: use the AsyncOpenAI client it is given, or run "
                     "blocking code as a command agent)")

    def __init__(self, *args, agent, limits: HarnessLimits | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_ref = agent
        self.limits = limits or HarnessLimits()
        self.gateway: Gateway | None = None
        self.command_slots: asyncio.Semaphore | None = None
        self.http_client = None  # async agents' shared connection pool
        self._failures_seen: dict[str, int] = {}  # message -> times, for `_warn_dropped`

    async def setup(self) -> None:
        self.agent = resolve_agent(self.agent_ref)
        if isinstance(self.agent, AgentCommand):  # hundreds of rollouts, not hundreds of processes
            self.command_slots = asyncio.Semaphore(self.limits.max_commands or max(4, os.cpu_count() or 1))
        else:
            self.http_client = shared_http_client()
        # An evaluation's gateway runs beside the worker's, in the trainer: a free port of its
        # own, or a fixed gateway_port would be bound twice (the run failed with EADDRINUSE).
        limits = dataclasses.replace(self.limits, port=0) if self.evaluating else self.limits
        self.gateway = Gateway(self, limits)
        url = await self.gateway.start()
        logger.info("Agent gateway listening on %s", url)
        await super().setup()

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self.http_client is not None:
                await self.http_client.shutdown()
                self.http_client = None
            if self.gateway is not None:
                await self.gateway.stop()

    async def generate_one(self, prompt, tools, group_id: int = 0) -> Rollout:
        """Not used: a harness rollout is an agent run on the whole row (`run_agent_rollout`)."""
        raise NotImplementedError(
            "HarnessRolloutLoop rolls out by running the agent on a dataset row "
            "(run_agent_rollout); the built-in tool loop's generate_one does not apply.")

    async def run_episode(self, row: dict, row_index: int, group_id: int) -> tuple:
        """The agent on the whole row instead of the env and tool loop; no env reward."""
        prompt, rollout = await self.run_agent_rollout(row)
        return row.get("prompt") or prompt, rollout, None

    def compute_advantages(self, group) -> np.ndarray:
        """Failed rollouts stay unscored (NaN), even when `reward_funcs` scored their empty
        completion, so they neither train nor shift their group's advantages."""
        for index, rollout in enumerate(group.rollouts):
            if rollout.metrics.get(FAILED_METRIC, [0.0])[0]:
                group.rewards[index] = math.nan
        return super().compute_advantages(group)

    def _warn_dropped(self, message: str) -> None:
        """Warn about a dropped rollout; the same failure again only at its 10th, 100th, ...
        time (an agent that fails every rollout, e.g. a command that cannot start, failed
        about 1000 times a minute on a 2-core box: one line each buried everything else)."""
        if len(self._failures_seen) >= 1000 and message not in self._failures_seen:
            self._failures_seen.clear()  # messages that differ every time: keep memory bounded
        seen = self._failures_seen[message] = self._failures_seen.get(message, 0) + 1
        if seen == 1:
            logger.warning("Rollout dropped: %s", message)
        elif seen >= 10 and str(seen).rstrip("0") == "1":  # 10, 100, 1000, ...
            logger.warning("Rollout dropped (the same failure %d times so far; warned at the "
                           "1st, 10th, 100th, ...; harness/errors_count counts them all): %s",
                           seen, message)

    async def _raise_if_server_lost(self, error: SamplerError) -> None:
        """Raise `error` as a lost server (`recovery.means_server_lost`: nothing answered, or
        `/health` does not answer now either); a server that still answers refused only that
        call, which the agent saw as a 502. A refusal of the run's LoRA adapter is no failure
        of the agent either: it is raised as the tool loop's request raises it
        (`recovery.restate_adapter_refusal`): a restarted server is lost, any other refusal
        stops the run (an evaluation) naming the adapter. (The max_staleness=0 push race never
        gets here: the call waited for the next version, `AsyncRolloutLoop._adapter_after_refusal`.)"""
        url = self.config.vllm_server_base_url
        restated = await restate_adapter_refusal(error, self.sampler, self.lora_name)
        if restated is not None:
            raise restated from error
        if not await means_server_lost(error, url):
            return
        if isinstance(error, ServerUnreachableError):
            raise error
        raise ServerUnreachableError(f"{error} (and {url}/health does not answer)") from error

    async def run_agent_rollout(self, row: dict) -> tuple[list[dict], Rollout]:
        """Run the agent once with its own gateway session; failures become a dropped rollout,
        but a run that lost the server raises `ServerUnreachableError` (the module doc).

        Returns the first call's messages (the rollout's prompt) and the rollout."""
        version = rollout_version()
        if version is None:
            version = int(self.model_version_value.value)
        failure: AgentFailure | None = None
        reward = None
        async with self.command_slots or contextlib.nullcontext():  # its budgets start here
            session = self.gateway.open_session(version)
            unfinished.record(lambda: _calls_so_far(session))  # should the run not return
            try:
                reward = await run_agent(self.agent, self.gateway.base_url, session.key, row,
                                         self.limits.timeout_s, self.gateway.unix_path, self.http_client)
            except AgentFailure as error:
                failure = error
            finally:
                self.gateway.close_session(session)
                while session.in_flight:  # a call still being sampled when the agent gave up
                    await asyncio.sleep(0.01)
        if session.sampler_error is not None:  # whatever the agent made of the 502
            await self._raise_if_server_lost(session.sampler_error)
        if failure is None and not session.turns:
            failure = no_reply_failure(self.agent, session)
        metrics = {
            "harness/calls_per_rollout": [float(len(session.turns))],
            "harness/errors_count": [float(failure is not None and failure.kind == "error")],
            "harness/timeout_count": [float(failure is not None and failure.kind == "timeout")],
            FAILED_METRIC: [float(failure is not None)],
            "harness/rejected_calls_count": [float(session.rejected_calls)],
            **_tool_metrics(session),
        }
        if failure is not None:
            self._warn_dropped(str(failure))
            rollout = Rollout(completion=[], completion_ids=[], turns=[], reward=math.nan,
                              metrics=metrics, dropped_turns=list(session.turns))
        else:
            completion = session.last_messages[len(session.first_messages or []):]
            rollout = Rollout(
                completion=completion,
                completion_ids=[t for turn in session.turns for t in turn.output_ids],
                turns=session.turns, tool_call_count=session.tool_calls, reward=reward,
                metrics=metrics)
        return session.first_messages or [], rollout


def _tool_metrics(session: AgentSession) -> dict[str, list[float]]:
    """The `tools/*` of an agent run's calls that the gateway parsed (their outcomes happen in
    the agent, unseen here)."""
    return {"tools/malformed_call_count": [float(session.malformed_calls)],
            "tools/parallel_calls_mean": [float(n) for n in session.parallel_calls]}


def _calls_so_far(session: AgentSession) -> list[Observation]:
    """`_tool_metrics` of a run that did not return (`rollout.unfinished`)."""
    if not session.tool_calls:
        return []
    return [(name, value) for name, values in _tool_metrics(session).items() for value in values]
