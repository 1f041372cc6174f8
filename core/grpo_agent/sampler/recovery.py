"""Bring a dead vLLM server back mid-run, push the trainer's weights into it, and go on.

Design decision: one home for the rule (issue 22). The rollout worker only notices: a
sampler call fails and `/health` does not answer, so it drops the group in flight (recorded
as consumed, reason `server_lost`: counted, never trained twice), raises the channels'
`server_down` flag and dispatches nothing more. The trainer owns the server and the weights,
so it restores (`ServerRecovery.restore`): a server this process started
(`ManagedVLLMServer`) is restarted on its port; an external one is waited for up to
`vllm_server_timeout`. Then the pusher re-opens its transfer group against the new server
(asking it its weight-transfer backend again: one restarted by hand may have other flags),
the current weights are pushed as the current version, the flag is cleared and the worker
goes on. Before the push, the server that came back is checked again by the start checks'
own rules (`check_restored_server`, `server_facts.check_training_server`: control routes,
`--logprobs-mode`, `--max-logprobs`, the model, room for `max_completion_length`; warnings for
token_budget and dtype); one restarted with another model or flags that would train wrong stops
the run instead of being trained on. The trainer reads the restored server's `max_model_len`
off `ServerRecovery.facts` (its token budget may follow it: `train.setup.token_budget`); the
worker re-reads the rest of its facts itself (`RolloutEngine`). A push that fails is retried
once the same way; a push sent in the background (`weight_sync.full`) fails at the next push
or `settle`, which retry it with the weights of that moment.

Under FSDP every rank takes part in a push (the full weights are gathered collectively), so
every rank takes part in a recovery too: after each push attempt the ranks agree on its
outcome with one small gather (inside the collective phase deadlines, so a dead rank is still
named); when rank 0 failed to send, rank 0 restores the server while the others wait in the
`server restore` phase, tells them how that went, and all ranks push again once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any

import httpx

from grpo_agent.sampler.client import SamplerClient, version_adapters
from grpo_agent.sampler.errors import (
    RequestRejectedError,
    SamplerError,
    ServerChangedError,
    ServerUnfitError,
    ServerUnreachableError,
    WeightSyncError,
)
from grpo_agent.sampler.server import managed_server_at
from grpo_agent.sampler.server_facts import (
    ServerFacts,
    ServerNeeds,
    check_training_server,
    probe_server,
)
from grpo_agent.stall import StageStalled

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
POLL_S = 1.0
ALIVE_GRACE_S = 30.0  # a managed server whose process lives gets this long to answer again
RESTARTS_METRIC = "server/restart_count"  # 1 per restore, summed over a window


def server_answers(base_url: str) -> bool:
    """Whether `/health` answers 200 right now."""
    try:
        return httpx.get(f"{base_url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


async def server_answers_async(base_url: str) -> bool:
    """`server_answers` for the worker's event loop."""
    try:
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as http:
            return (await http.get(f"{base_url.rstrip('/')}/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def means_server_lost(error: BaseException, base_url: str) -> bool:
    """Whether a sampler failure means the server went away: nothing answered (even if it
    answers again by now, it may be a new server without our weights), or the call failed
    otherwise and `/health` does not answer either. A request it refused never is."""
    if isinstance(error, ServerUnreachableError):
        return True
    if not isinstance(error, SamplerError) or isinstance(error, RequestRejectedError):
        return False
    return not await server_answers_async(base_url)


class AdapterServedAgain(ServerUnreachableError):
    """A server refused one of the run's adapters, and serves it again by now: it was restarted
    under the request and the trainer's restore has pushed the adapter again. Lost to an
    evaluation (pinned: a restore during it is never scored); a training rollout sends the
    request again (`AsyncRolloutLoop._adapter_after_refusal`) instead of asking for a second,
    needless restore."""


async def restate_adapter_refusal(error: BaseException, sampler: SamplerClient,
                                  lora_name: str | None) -> SamplerError | None:
    """`error` restated when it is the server refusing one of the run's LoRA adapters (named
    after `lora_name`) as an unknown model (vLLM's 404 "The model `run-v3` does not exist"),
    else None; the server's model list tells why. Holding none of the run's adapters, it was
    restarted under the request, before (or while) the trainer's restore pushed the adapter
    again: a `ServerUnreachableError`, which `means_server_lost` calls lost. Holding that one
    again by now, it was restarted and the restore's push has landed: `AdapterServedAgain`.
    Still holding others of the run's adapters, it ran on and something unloaded that one: a
    `RequestRejectedError` naming it and the likely cause. Limit: a running server whose every
    adapter of the run was unloaded by hand reads as restarted."""
    if lora_name is None or not isinstance(error, RequestRejectedError) or error.status_code != 404:
        return None
    refused = re.search(rf"`({re.escape(lora_name)}-v\d+)`", error.server_message)
    if refused is None:
        return None
    adapter = refused.group(1)
    try:
        ours = version_adapters(await sampler.served_models(), lora_name)
    except SamplerError as listing:
        if not await means_server_lost(listing, sampler.base_url):
            return None
        return ServerUnreachableError(f"{error.reason} (and then GET /v1/models: {listing.reason})")
    if adapter in ours:
        return AdapterServedAgain(
            f"{error.reason} (the server now serves it again: it was restarted, and the "
            "trainer's restore pushed the adapter again)")
    if not ours:
        return ServerUnreachableError(
            f"{error.reason} (the server now serves none of this run's LoRA adapters: it was "
            "restarted, and the trainer's restore pushes the adapter again)")
    return RequestRejectedError(
        f"The vLLM server at {sampler.base_url} refused the LoRA adapter {adapter!r} as an "
        f"unknown model while it still serves this run's {', '.join(ours)}: something unloaded "
        "it (a run started with the same output_dir on this server unloads the adapters named "
        "after it). Give each run on a server its own output_dir, and unload no run's adapters "
        "by hand.", status_code=404, server_message=error.server_message)


def restore_server(base_url: str, timeout_s: float) -> str:
    """Make the server at `base_url` answer again; returns what it took (for the log line).

    Ours: restarted (after `ALIVE_GRACE_S` if its process still lives). External: waited for
    up to `timeout_s`, saying so at once (only a person can restart it, and the wait may be
    half an hour), then `ServerUnreachableError` saying what to do."""
    server = managed_server_at(base_url)
    if server is not None:
        if server.is_running() and _wait_for_health(base_url, ALIVE_GRACE_S):
            return "answered again"
        began = time.monotonic()
        server.restart()
        return f"was restarted (pid {server.pid}, {time.monotonic() - began:.0f} s)"
    began = time.monotonic()
    if not server_answers(base_url):
        logger.warning(
            "The vLLM server at %s (not started by this run) does not answer; waiting up to "
            "vllm_server_timeout=%g s for it to come back. Restart it at the same URL with the "
            "same model and flags: the trainer then pushes its weights again (by the weight "
            "transfer the new server is configured for) and goes on.", base_url, timeout_s)
    if _wait_for_health(base_url, timeout_s):
        return f"came back after {time.monotonic() - began:.0f} s"
    raise ServerUnreachableError(
        f"The vLLM server at {base_url} stopped answering and did not come back within "
        f"vllm_server_timeout={timeout_s:g} s. Restart it (same URL) and resume from the last "
        f"checkpoint, or raise vllm_server_timeout to wait longer.")


def check_restored_server(base_url: str, timeout_s: float, needs: ServerNeeds) -> ServerFacts:
    """The start checks (`check_training_server`) on the server that came back (a person may
    have restarted it with another model, a shorter `--max-model-len` or without
    `--logprobs-mode processed_logprobs`): `ServerChangedError` naming it, what it is now and
    the restart's fix; its facts when it passes."""
    facts = asyncio.run(_probe(base_url, timeout_s))
    try:
        check_training_server(facts, base_url, needs, restored=True)
    except ServerUnfitError as error:
        raise ServerChangedError(str(error), start_command=error.start_command) from None
    return facts


async def _probe(base_url: str, timeout_s: float):
    async with SamplerClient(base_url, timeout=timeout_s) as client:
        return await probe_server(client)


def _wait_for_health(base_url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if server_answers(base_url):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


class _OneProcess:
    """The ranks of a single trainer process: no collective to agree through."""

    rank = 0

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def during(self, phase: str, **detail: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class ServerRecovery:
    """The trainer's side: restore the server, re-open the transfer group, push, count.

    `ranks` are the trainer's processes (`train.collectives.RankPhases` under FSDP): `rank`,
    `gather(value)` (every rank's value, a collective) and `during(phase)` (the collective
    phase the ranks wait in). Every rank calls `push` and `restore`; only rank 0 touches the
    server, and one small gather after each step makes every rank take the same decision."""

    def __init__(self, base_url: str, timeout_s: float, *, ranks: Any = None,
                 needs: ServerNeeds | None = None) -> None:
        """`needs`: what a server that came back must still meet (`check_restored_server`);
        None checks nothing."""
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.ranks = ranks or _OneProcess()
        self.needs = needs
        self.restarts = 0
        # The last restored server's facts, on rank 0 when `needs` were checked; else None.
        self.facts: ServerFacts | None = None

    def push(self, pusher: Any, model: Any, version: int) -> dict[str, float]:
        """`pusher.push`, retried once after restoring the server and re-opening the group."""
        return self._retried(lambda: pusher.push(model, version), pusher, model, version)

    def settle(self, pusher: Any, model: Any, version: int) -> dict[str, float]:
        """Until the server serves `version`: a background push (`weight_sync.full`) awaited,
        and retried as `push` retries if it failed."""
        return self._retried(pusher.wait, pusher, model, version)

    def _retried(self, attempt: Any, pusher: Any, model: Any, version: int) -> dict[str, float]:
        metrics, failures = self._attempt(attempt, version)
        if not failures:
            return metrics
        if self.ranks.rank == 0:
            logger.warning("Pushing weights version %d failed (%s); retrying once after "
                           "restoring the server if it is down (and re-opening a transfer group, "
                           "where the push has one).", version, failures[0])
        return self.restore(pusher, model, version, cause="a weight push failed")

    def restore(self, pusher: Any, model: Any, version: int, *, cause: str) -> dict[str, float]:
        """Bring the server back, push the current weights as `version`; one log line."""
        with self.ranks.during("server restore", version=version):
            what, problem = None, None
            if self.ranks.rank == 0:
                try:
                    what = restore_server(self.base_url, self.timeout_s)
                    if self.needs is not None:
                        self.facts = check_restored_server(self.base_url, self.timeout_s,
                                                           self.needs)
                except Exception as error:  # noqa: BLE001 - the other ranks must hear of it
                    problem = error
            outcome = self.ranks.gather(_describe(problem))[0]
            if problem is not None:
                raise problem
            if outcome is not None:
                raise ServerUnreachableError(
                    f"Rank 0 could not bring the vLLM server at {self.base_url} back ({cause}): "
                    f"{outcome}. See rank 0's log.")
        reopen = getattr(pusher, "reopen", None)
        if reopen is not None:
            reopen()
        # A retry counts once it landed (a background push returns before).
        metrics, _ = self._attempt(lambda: {**pusher.push(model, version), **pusher.wait()},
                                   version, last=True)
        self.restarts += 1
        metrics[RESTARTS_METRIC] = 1.0
        if self.ranks.rank == 0:
            logger.warning("vLLM server at %s %s after %s; weights version %d pushed again, "
                           "training goes on (restart %d of this run).", self.base_url, what,
                           cause, version, self.restarts)
        return metrics

    def _attempt(self, attempt: Any, version: int, *,
                 last: bool = False) -> tuple[dict[str, float], dict[int, str]]:
        """One push (`attempt`) on every rank, then the ranks agree on its outcome: the metrics
        and the failures by rank. Rank 0's failure to send (the server may be gone) comes back for a
        retry unless this was the `last` attempt; a failure of another rank is no server loss.
        Otherwise every rank raises: its own error, or one naming the rank that failed."""
        mine, metrics = None, {}
        try:
            metrics = dict(attempt())
        except (SamplerError, httpx.HTTPError, RuntimeError) as error:
            if isinstance(error, StageStalled):
                raise
            mine = error
        outcomes = self.ranks.gather(_describe(mine))
        failures = {r: outcome for r, outcome in enumerate(outcomes) if outcome is not None}
        others = sorted(set(failures) - {0})
        if others or (last and failures):
            if mine is not None:
                raise mine
            failed = others or [0]
            raise WeightSyncError(f"Rank(s) {failed} failed in the push of weights version "
                                  f"{version}: {failures[failed[0]]}. See their logs.")
        return metrics, failures


def _describe(error: BaseException | None) -> str | None:
    """What failed, for the retry's warning and the other ranks: a `SamplerError`'s `reason`,
    without the advice its message may end with ("resume from the last checkpoint"), which
    holds only once the run stops; the rank that failed raises the whole error then."""
    if error is None:
        return None
    return f"{type(error).__name__}: {error.reason if isinstance(error, SamplerError) else error}"
