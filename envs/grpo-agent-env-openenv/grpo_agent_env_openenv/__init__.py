"""OpenEnv environments as a grpo-agent env: `--env openenv --env-arg env=module:Class`.

Design decision: the OpenEnv `Environment` runs in process (no server, no container) and the
model acts through one tool, `step(action)`, whose argument is the JSON action an OpenEnv
client would send to the env's server; it is turned into the env's `Action` with openenv-core's
own `deserialize_action`, so typed actions and MCP tool calls (`{"type": "call_tool",
"tool_name": ..., "arguments": {...}}`) work alike. `reset` shows the first observation and the
action schema (an MCP env lists its tools instead). The reward is the sum of the observations'
rewards, the env's own scoring. Rows are reset seeds, so a split is reproducible. openenv is
imported lazily: plugins load at CLI start-up.
"""
from __future__ import annotations

import importlib
import inspect
import json
import typing
from typing import Any

from grpo_agent import Option, environment, hookimpl

DEFAULT_ENV = "grpo_agent_env_openenv.guess:GuessNumberEnvironment"


def import_object(path: str, what: str) -> Any:
    """`module:attr` to the object, with an error naming the option and the fix."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"openenv option {what}={path!r} must be 'module:Class' "
                         f"(for example {DEFAULT_ENV!r}).")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"openenv option {what}={path!r}: {err}. Install the package that "
                         "defines it, or give another 'module:Class'.") from err


def action_class(env_cls: type, action: str) -> type:
    """The env's Action class: the `action` option, else `step`'s annotation (MCP envs and an
    unannotated `step` get openenv's base `Action`, which routes list_tools / call_tool)."""
    from openenv.core.env_server.types import Action

    if action:
        cls = import_object(action, "action")
    else:
        cls = typing.get_type_hints(env_cls.step).get("action", Action)
    if not (inspect.isclass(cls) and issubclass(cls, Action)):
        raise ValueError(f"openenv: {cls!r} is not an openenv Action class; set --env-arg "
                         "action=module:Class to the env's action type.")
    return cls


def seed_rows(env: str = DEFAULT_ENV, action: str = "", size: int = 1000, seed: int = 0):
    """`size` rows, one reset seed each (`seed`, `seed + 1`, ...)."""
    from datasets import Dataset

    if size < 1:
        raise ValueError(f"openenv dataset size must be at least 1, got {size}.")
    return Dataset.from_dict({"seed": list(range(seed, seed + size))})


def observation_text(observation: Any) -> str:
    """What the model reads back: an MCP tool's text result (or its error), else the
    observation's fields as JSON, with the reward and whether the episode is done."""
    from openenv.core.env_server.mcp_types import CallToolObservation
    from openenv.core.env_server.serialization import serialize_observation

    if isinstance(observation, CallToolObservation):
        if observation.error is not None:
            return f"error: {observation.error.message}"
        result = observation.result
        content = getattr(result, "content", None)
        text = ("\n".join(getattr(part, "text", str(part)) for part in content)
                if content is not None else str(result))
    else:
        fields = serialize_observation(observation)["observation"]
        text = json.dumps(fields, default=str)
    if observation.done:
        text += f"\n(episode over, reward {observation.reward})"
    return text


def solve_guess(env: OpenEnvEnv, row: dict) -> None:
    """Gold play for `env check`: binary search on the shipped guess-number env."""
    from grpo_agent.plugins.check import NoGoldAnswer

    from grpo_agent_env_openenv.guess import HIGH, LOW, GuessNumberEnvironment

    if not isinstance(env.env, GuessNumberEnvironment):
        raise NoGoldAnswer(f"no solver for {type(env.env).__name__}")
    low, high = LOW, HIGH
    while not env.done:
        middle = (low + high) // 2
        answer = env.step({"type": "call_tool", "tool_name": "guess", "arguments": {"number": middle}})
        low, high = (middle + 1, high) if answer.startswith("higher") else (low, middle - 1)


@environment(
    "openenv",
    version=1,
    dataset=seed_rows,
    tool_examples={"step": {"action": {"type": "call_tool", "tool_name": "guess",
                                       "arguments": {"number": 32}}}},
    gold=solve_guess,
    options=[
        Option("env", str, DEFAULT_ENV, "OpenEnv Environment class to run in process, module:Class"),
        Option("action", str, "", "its Action class, module:Class (default: step()'s annotation)"),
        Option("size", int, 1000, "rows (reset seeds) in the dataset"),
        Option("seed", int, 0, "first reset seed"),
    ],
    description="OpenEnv environments in process (--env-arg env=module:Class); step(action) as a tool.",
)
class OpenEnvEnv:
    """One OpenEnv episode per rollout, stepped through the `step` tool."""

    def __init__(self, env: str = DEFAULT_ENV, action: str = "", size: int = 1000, seed: int = 0):
        from openenv.core.env_server.interfaces import Environment

        env_cls = import_object(env, "env")
        if not (inspect.isclass(env_cls) and issubclass(env_cls, Environment)):
            raise ValueError(f"openenv option env={env!r} is not an openenv Environment class.")
        self.action_cls = action_class(env_cls, action)
        self.env = env_cls()
        self.done, self.total = False, 0.0

    def reset(self, seed: int, **row) -> str:
        from openenv.core.env_server.mcp_environment import MCPEnvironment
        from openenv.core.env_server.mcp_types import ListToolsAction

        accepts_seed = "seed" in inspect.signature(self.env.reset).parameters
        observation = self.env.reset(seed=seed) if accepts_seed else self.env.reset()
        self.done, self.total = bool(observation.done), float(observation.reward or 0.0)
        task = observation.metadata.get("task") if observation.metadata else None
        parts = [task or observation_text(observation), ""]
        if isinstance(self.env, MCPEnvironment):
            tools = [tool.model_dump() for tool in self.env.step(ListToolsAction()).tools]
            parts.append("Act with the `step` tool; each action calls one of these tools: "
                         '{"type": "call_tool", "tool_name": NAME, "arguments": {...}}.\n'
                         f"Tools: {json.dumps(tools)}")
        else:
            schema = self.action_cls.model_json_schema()
            parts.append(f"Act with the `step` tool; the action is a JSON object of this schema: "
                         f"{json.dumps(schema)}")
        return "\n".join(parts)

    def get_reward(self) -> float:
        return self.total

    def step(self, action: dict) -> str:
        """
        Take one action in the environment and return what it observed.

        Args:
            action: The action as a JSON object, in the form the reset message describes.

        Returns:
            The observation after the action, with the reward once the episode is over.
        """
        from openenv.core.env_server.serialization import deserialize_action

        if self.done:
            raise RuntimeError("The episode is over; no more actions are accepted.")
        if isinstance(action, str):
            action = json.loads(action)
        observation = self.env.step(deserialize_action(action, self.action_cls))
        self.total += float(observation.reward or 0.0)
        self.done = bool(observation.done)
        return observation_text(observation)


@hookimpl
def register_environments(register):
    register(OpenEnvEnv)
