"""A number-guessing OpenEnv environment, written against openenv-core's own API.

Why it exists: PyPI's OpenEnv distributions (`openenv-core`, `openenv`) ship the framework but
no environment (OpenEnv's envs are Docker images and Hugging Face Spaces), so this package
ships one: an `MCPEnvironment` whose actions are FastMCP tools, run in process or served by
openenv-core's own server (`serve.py`). The task is an observation field, not metadata, because
the server leaves metadata out of what it sends; the score is set in both `step` (in process)
and `step_async` (what the server's WebSocket sessions call).
"""
from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, MAX_GUESSES = 1, 64, 8


class TaskObservation(Observation):
    """The reset observation: the task in words."""

    task: str


class GuessNumberEnvironment(MCPEnvironment):
    """Find a secret number in [1, 64] with at most 8 `guess` calls; reward 1 when found."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("guess-number")

        @mcp.tool()
        def guess(number: int) -> str:
            """Guess the secret number; the answer says higher, lower or correct."""
            return self._guess(number)

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret, self.found, self.guesses = LOW, False, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> Observation:
        self.secret = random.Random(seed).randint(LOW, HIGH)
        self.found, self.guesses = False, 0
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return TaskObservation(done=False, reward=0.0, task=(
            f"I picked a whole number from {LOW} to {HIGH}. Find it with at most "
            f"{MAX_GUESSES} guesses; each answer says higher, lower or correct."))

    def _guess(self, number: int) -> str:
        if self.found or self.guesses >= MAX_GUESSES:
            return "The game is over."
        self.guesses += 1
        if number == self.secret:
            self.found = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def _scored(self, observation: Observation) -> Observation:
        self._state.step_count += 1
        observation.done = self.found or self.guesses >= MAX_GUESSES
        observation.reward = 1.0 if self.found and observation.done else 0.0
        return observation

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None,
                         **kwargs: Any) -> Observation:
        return self._scored(await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action: Action, timeout_s: float | None = None,
                   **kwargs: Any) -> Observation:
        raise ValueError(f"unknown action {type(action).__name__}; call the `guess` tool")

    @property
    def state(self) -> State:
        return self._state
