"""Failures that cost one group, not the run: a prompt over `max_model_len`, a raising `reset`
or `get_reward`.

Design decision: one bad row (a prompt too long for the server, an environment whose reset
fails for that task) should not stop hours of training, so its group is dropped, recorded as
consumed (the ledger moves past it, nothing trains twice) and counted
(`rollout/{reason}_group_count`), with a warning that names the row and the fix. A run where
*every* group fails this way is broken, not unlucky: after `GROUP_FAILURE_WINDOW` such groups
in a row it stops with the last error, the same rule rewards follow (`scoring.RewardFailureTracker`).
"""
from __future__ import annotations

import logging

from grpo_agent.rollout.environments import EnvironmentEpisodeError
from grpo_agent.sampler.errors import RequestRejectedError

logger = logging.getLogger(__name__)

GROUP_FAILURE_WINDOW = 10
PROMPT_TOO_LONG, ENV_ERROR = "prompt_too_long", "env_error"
_TOO_LONG_WORDS = ("maximum model length", "maximum context length", "max_model_len")


class GroupFailureError(RuntimeError):
    """Every group of a window failed the same way: the run cannot make progress."""


def failure_reason(error: BaseException) -> str | None:
    """The drop reason when `error` costs only its group, else None (it stops the run)."""
    if isinstance(error, EnvironmentEpisodeError):
        return ENV_ERROR
    if isinstance(error, RequestRejectedError) and error.status_code == 400:
        text = (error.server_message or str(error)).lower()
        if any(words in text for words in _TOO_LONG_WORDS):
            return PROMPT_TOO_LONG
    return None


def _advice(reason: str, error: BaseException, prompt_index: int, row_index: int) -> str:
    if reason == PROMPT_TOO_LONG:
        return (f"The prompt of dataset row {row_index} (prompt {prompt_index}) does not fit the "
                f"server's max_model_len ({error}). Its group is dropped and counted "
                f"(rollout/prompt_too_long_group_count). Drop long prompts from the dataset (or "
                f"in AsyncRolloutLoop.filter_prompt), or start the server with a larger "
                f"--max-model-len.")
    return (f"{error} (dataset row {row_index}, prompt {prompt_index}). Its group is dropped and "
            f"counted (rollout/env_error_group_count); fix the environment (its reset or get_reward) for this row.")


class GroupFailureTracker:
    """Warns once per reason; raises `GroupFailureError` after a window of failed groups."""

    def __init__(self, window: int = GROUP_FAILURE_WINDOW) -> None:
        self.window = window
        self.streak = 0
        self._warned: set[str] = set()

    def succeeded(self) -> None:
        self.streak = 0

    def failed(self, reason: str, error: BaseException, prompt_index: int, row_index: int) -> None:
        self.streak += 1
        advice = _advice(reason, error, prompt_index, row_index)
        if self.streak >= self.window:
            raise GroupFailureError(
                f"{self.streak} groups in a row failed, so the run stops (no group can train). "
                f"The last: {advice}") from error
        if reason not in self._warned:  # later ones are counted, not logged again
            self._warned.add(reason)
            logger.warning("%s", advice, exc_info=reason == ENV_ERROR)
