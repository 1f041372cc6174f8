"""A number-guessing OpenEnv environment, written against openenv-core's own API.

Why it exists: PyPI's OpenEnv distributions (`openenv-core`, `openenv`) ship the framework but
no environment (OpenEnv's envs are Docker images and Hugging Face Spaces), so this package
ships one that runs in process: an `MCPEnvironment` whose actions are FastMCP tools, reset
and stepped exactly as OpenEnv's HTTP server would step it.
"""
from __future__ import annotations

import random
from typing import Any, Optional
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, MAX_GUESSES = 1, 64, 8


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

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> Observation:
        self.secret = random.Random(seed).randint(LOW, HIGH)
        self.found, self.guesses = False, 0
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation(done=False, reward=0.0, metadata={
            "task": f"I picked a whole number from {LOW} to {HIGH}. Find it with at most "
                    f"{MAX_GUESSES} guesses; each answer says higher, lower or correct."})

    def _guess(self, number: int) -> str:
        if self.found or self.guesses >= MAX_GUESSES:
            return "The game is over."
        self.guesses += 1
        if number == self.secret:
            self.found = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        observation.done = self.found or self.guesses >= MAX_GUESSES
        observation.reward = 1.0 if self.found and observation.done else 0.0
        return observation

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None,
                   **kwargs: Any) -> Observation:
        raise ValueError(f"unknown action {type(action).__name__}; call the `guess` tool")

    @property
    def state(self) -> State:
        return self._state
