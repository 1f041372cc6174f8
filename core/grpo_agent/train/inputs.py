"""What the trainer's constructor is given, resolved before the worker is spawned.

Design decision: the rollout worker is a spawned process, so reward functions, tools and
environment factories travel to it by pickle. Registered names are turned into objects here,
once, and everything is checked to pickle, so a bad input fails at construction with its name
instead of inside the child.
"""
from __future__ import annotations

from grpo_agent.plugins import check_picklable, load_registry
from grpo_agent.plugins.registry import with_options


def resolve_plugins(reward_funcs, tools, environment_factory, plugin_args=None):
    """Turn registered names into objects, bind the options rewards declare (from the config's
    `plugin_args`), and check everything pickles (the worker is spawned)."""
    if reward_funcs is None:
        reward_funcs = []
    elif not isinstance(reward_funcs, (list, tuple)):
        reward_funcs = [reward_funcs]
    tools = list(tools or [])
    env_refs = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    rewards = list(reward_funcs)
    if any(isinstance(ref, str) for ref in [*reward_funcs, *tools, *env_refs]):
        registry = load_registry()
        rewards = [registry.resolve_reward(f) if isinstance(f, str) else f for f in reward_funcs]
        tools = [registry.resolve_tool(t) if isinstance(t, str) else t for t in tools]
        if environment_factory is not None:
            environment_factory = registry.resolve_environment(environment_factory)
    reward_funcs = [with_options("reward", obj, ref, plugin_args) for obj, ref in zip(rewards, reward_funcs)]
    check_picklable(
        {"reward_funcs": reward_funcs, "tools": tools, "environment_factory": environment_factory}
    )
    return list(reward_funcs), tools, environment_factory
