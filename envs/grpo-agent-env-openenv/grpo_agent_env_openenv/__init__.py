"""OpenEnv environments as a grpo-agent env: `--env openenv --env-arg env=module:Class` runs
the env in process, `--env-arg url=http://HOST:PORT` plays an OpenEnv server (`remote.py`).

Design decision: both ways answer with the JSON an OpenEnv server sends (in process through
openenv's own `serialize_observation`), so one code path renders observations and sums rewards.
The model acts through one tool, `step(action)`, whose argument is the JSON action an OpenEnv
client sends to the env's server; openenv-core's own `deserialize_action` (here, or on the
server) turns it into the env's `Action`, so typed actions and MCP tool calls (`{"type":
"call_tool", "tool_name": ..., "arguments": {...}}`) work alike. `reset` shows the first
observation and the action schema (an MCP env lists its tools instead). The reward is the sum
of the observations' rewards, the env's own scoring. Rows are reset seeds, so a split is
reproducible. openenv is imported lazily: plugins load at CLI start-up.
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


def environment_class(env: str) -> type:
    """The OpenEnv `Environment` class named by the `env` option."""
    from openenv.core.env_server.interfaces import Environment

    env_cls = import_object(env, "env")
    if not (inspect.isclass(env_cls) and issubclass(env_cls, Environment)):
        raise ValueError(f"openenv option env={env!r} is not an openenv Environment class.")
    return env_cls


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


def seed_rows(size: int = 1000, seed: int = 0, **_backend):
    """`size` rows, one reset seed each (`seed`, `seed + 1`, ...)."""
    from datasets import Dataset

    if size < 1:
        raise ValueError(f"openenv dataset size must be at least 1, got {size}.")
    return Dataset.from_dict({"seed": list(range(seed, seed + size))})


def payload(observation: Any) -> dict[str, Any]:
    """An observation as the JSON an OpenEnv server sends for it (`observation` fields without
    metadata, `reward`, `done`), so an env in process reads like one behind a URL."""
    from openenv.core.env_server.serialization import serialize_observation
    from pydantic_core import to_jsonable_python

    return to_jsonable_python(serialize_observation(observation))


def observation_text(answer: dict[str, Any]) -> str:
    """What the model reads back: an MCP tool's text result (or its error), a lone text field
    as itself, else the fields as JSON; with the reward once the episode is over."""
    fields = answer.get("observation") or {}
    if "tool_name" in fields and ("result" in fields or "error" in fields):  # an MCP tool call
        result, error = fields.get("result"), fields.get("error")
        content = result.get("content") if isinstance(result, dict) else None
        if error:
            text = f"error: {error.get('message', error)}"
        elif content is not None:
            text = "\n".join(part.get("text", json.dumps(part)) for part in content)
        else:
            text = json.dumps(result, default=str)
    elif len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        text = next(iter(fields.values()))
    else:
        text = json.dumps(fields, default=str)
    if answer.get("done"):
        text += f"\n(episode over, reward {answer.get('reward')})"
    return text


class LocalEnv:
    """An OpenEnv `Environment` class run in this process, answering as its server would."""

    def __init__(self, env: str, action: str):
        env_cls = environment_class(env)
        self.action_cls = action_class(env_cls, action)
        self.env = env_cls()

    def name(self) -> str:
        return type(self.env).__name__

    def action_schema(self) -> dict[str, Any]:
        return self.action_cls.model_json_schema()

    def reset(self, seed: int) -> dict[str, Any]:
        accepts_seed = "seed" in inspect.signature(self.env.reset).parameters
        return payload(self.env.reset(seed=seed) if accepts_seed else self.env.reset())

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        from openenv.core.env_server.serialization import deserialize_action

        return payload(self.env.step(deserialize_action(action, self.action_cls)))

    def tools(self) -> list[dict] | None:
        from openenv.core.env_server.mcp_environment import MCPEnvironment
        from openenv.core.env_server.mcp_types import ListToolsAction

        if not isinstance(self.env, MCPEnvironment):
            return None
        return [tool.model_dump() for tool in self.env.step(ListToolsAction()).tools]

    def end(self) -> None:
        """Nothing to release: the instance is reset for the next episode."""


def solve_guess(env: OpenEnvEnv, row: dict) -> None:
    """Gold play for `env check`: binary search on the shipped guess-number env, in process or
    behind a URL (recognised by its name, the server's `/metadata`)."""
    from grpo_agent.plugins.check import NoGoldAnswer

    from grpo_agent_env_openenv.guess import HIGH, LOW, MAX_GUESSES, GuessNumberEnvironment

    name = env.backend.name()
    if name != GuessNumberEnvironment.__name__:
        raise NoGoldAnswer(f"no solver for {name}")
    low, high = LOW, HIGH
    for _ in range(MAX_GUESSES):  # bounded: a server that never ends the episode cannot hang us
        if env.done:
            break
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
        Option("url", str, "", "an OpenEnv server to play instead (http://HOST:PORT); env and action are then unused"),
        Option("timeout_s", float, 60.0, "with url: seconds to wait for the server's answer"),
        Option("size", int, 1000, "rows (reset seeds) in the dataset"),
        Option("seed", int, 0, "first reset seed"),
    ],
    description="OpenEnv environments in process (env=module:Class) or by URL (url=http://...); step(action) as a tool.",
)
class OpenEnvEnv:
    """One OpenEnv episode per rollout, stepped through the `step` tool."""

    def __init__(self, env: str = DEFAULT_ENV, action: str = "", url: str = "",
                 timeout_s: float = 60.0, size: int = 1000, seed: int = 0):
        if url:
            from grpo_agent_env_openenv.remote import RemoteEnv

            self.backend = RemoteEnv(url, timeout_s)
        else:
            self.backend = LocalEnv(env, action)
        self.done, self.total, self.lost = False, 0.0, None

    def reset(self, seed: int, **row) -> str:
        answer = self.backend.reset(seed)
        self.done, self.total, self.lost = bool(answer.get("done")), float(answer.get("reward") or 0.0), None
        parts = [observation_text(answer), ""]
        tools = self.backend.tools()
        if tools is not None:
            parts.append("Act with the `step` tool; each action calls one of these tools: "
                         '{"type": "call_tool", "tool_name": NAME, "arguments": {...}}.\n'
                         f"Tools: {json.dumps(tools)}")
        else:
            parts.append(f"Act with the `step` tool; the action is a JSON object of this schema: "
                         f"{json.dumps(self.backend.action_schema())}")
        return "\n".join(parts)

    def get_reward(self) -> float:
        """The episode's summed rewards; its server session (if any) closes here. An episode
        whose server went away raises: its group is dropped and counted, not scored."""
        self.backend.end()
        if self.lost is not None:
            raise self.lost
        return self.total

    def step(self, action: dict) -> str:
        """
        Take one action in the environment and return what it observed.

        Args:
            action: The action as a JSON object, in the form the reset message describes.

        Returns:
            The observation after the action, with the reward once the episode is over.
        """
        from grpo_agent_env_openenv.remote import OpenEnvServerError

        if self.done:
            raise RuntimeError("The episode is over; no more actions are accepted.")
        if isinstance(action, str):
            action = json.loads(action)
        try:
            answer = self.backend.step(action)
        except OpenEnvServerError as error:
            self.lost = error
            raise
        self.total += float(answer.get("reward") or 0.0)
        self.done = bool(answer.get("done"))
        return observation_text(answer)


@hookimpl
def register_environments(register):
    register(OpenEnvEnv)
