"""Bring a dead vLLM server back mid-run, push the trainer's weights into it, and go on.

Design decision: one home for the rule (issue 22). The rollout worker only notices: a
sampler call fails and `/health` does not answer, so it drops the group in flight (recorded
as consumed, reason `server_lost`: counted, never trained twice), raises the channels'
`server_down` flag and dispatches nothing more. The trainer owns the server and the weights,
so it restores (`ServerRecovery.restore`): a server this process started
(`ManagedVLLMServer`) is restarted on its port; an external one is waited for up to
`vllm_server_timeout`. Then the pusher re-opens its transfer group against the new server,
the current weights are pushed as the current version, the flag is cleared and the worker
goes on. A push that fails is retried once the same way. Only a single trainer process
recovers: under FSDP a retried push would need every rank, so the error stands.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from grpo_agent.sampler.errors import RequestRejectedError, SamplerError, ServerUnreachableError
from grpo_agent.sampler.server import managed_server_at
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


def restore_server(base_url: str, timeout_s: float) -> str:
    """Make the server at `base_url` answer again; returns what it took (for the log line).

    Ours: restarted (after `ALIVE_GRACE_S` if its process still lives). External: waited for
    up to `timeout_s`, then `ServerUnreachableError` saying what to do."""
    server = managed_server_at(base_url)
    if server is not None:
        if server.is_running() and _wait_for_health(base_url, ALIVE_GRACE_S):
            return "answered again"
        began = time.monotonic()
        server.restart()
        return f"was restarted (pid {server.pid}, {time.monotonic() - began:.0f} s)"
    began = time.monotonic()
    if _wait_for_health(base_url, timeout_s):
        return f"came back after {time.monotonic() - began:.0f} s"
    raise ServerUnreachableError(
        f"The vLLM server at {base_url} stopped answering and did not come back within "
        f"vllm_server_timeout={timeout_s:g} s. Restart it (same URL) and resume from the last "
        f"checkpoint, or raise vllm_server_timeout to wait longer.")


def _wait_for_health(base_url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if server_answers(base_url):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


class ServerRecovery:
    """The trainer's side: restore the server, re-open the transfer group, push, count."""

    def __init__(self, base_url: str, timeout_s: float, *, enabled: bool = True) -> None:
        """`enabled` False (FSDP ranks > 1): failures propagate unchanged."""
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.restarts = 0

    def push(self, pusher: Any, model: Any, version: int) -> dict[str, float]:
        """`pusher.push`, retried once after restoring the server and re-opening the group."""
        try:
            return pusher.push(model, version)
        except (SamplerError, httpx.HTTPError, RuntimeError) as error:
            if not self.enabled or isinstance(error, StageStalled):
                raise
            logger.warning("Pushing weights version %d failed (%s: %s); retrying once after "
                           "re-opening the transfer group.", version, type(error).__name__, error)
            return self.restore(pusher, model, version, cause="a weight push failed")

    def restore(self, pusher: Any, model: Any, version: int, *, cause: str) -> dict[str, float]:
        """Bring the server back, push the current weights as `version`; one log line."""
        if not self.enabled:
            raise ServerUnreachableError(
                f"The vLLM server at {self.base_url} stopped answering ({cause}); restarting it "
                f"mid-run needs a single trainer process (not FSDP). Resume from the last "
                f"checkpoint once it answers.")
        what = restore_server(self.base_url, self.timeout_s)
        reopen = getattr(pusher, "reopen", None)
        if reopen is not None:
            reopen()
        metrics = dict(pusher.push(model, version))
        self.restarts += 1
        metrics[RESTARTS_METRIC] = 1.0
        logger.warning("vLLM server at %s %s after %s; weights version %d pushed again, "
                       "training goes on (restart %d of this run).", self.base_url, what, cause,
                       version, self.restarts)
        return metrics
