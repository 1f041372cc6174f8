"""The plugin host: hookspecs, marking decorators, and the registry plugins resolve into.

Import from here: `load_registry()` gives the process-wide `Registry` (built-ins plus installed
entry points); `check_picklable` enforces the spec's pickling rule before a run starts.
"""
from grpo_agent.plugins.decorators import (
    advantage_estimator,
    agent,
    environment,
    prompt_filter,
    reward,
    tool,
)
from grpo_agent.plugins.errors import (
    DuplicateNameError,
    OptionError,
    PluginError,
    PluginImportError,
    ToolSchemaError,
    UnknownNameError,
)
from grpo_agent.plugins.hookspecs import hookimpl, hookspec
from grpo_agent.plugins.manager import build_registry, clear_cache, load_environment, load_registry
from grpo_agent.plugins.options import Option
from grpo_agent.plugins.pickling import check_picklable
from grpo_agent.plugins.registry import EnvironmentSpec, Registry

__all__ = [
    "DuplicateNameError",
    "EnvironmentSpec",
    "Option",
    "OptionError",
    "PluginError",
    "PluginImportError",
    "Registry",
    "ToolSchemaError",
    "UnknownNameError",
    "advantage_estimator",
    "agent",
    "build_registry",
    "check_picklable",
    "clear_cache",
    "environment",
    "hookimpl",
    "hookspec",
    "load_environment",
    "load_registry",
    "prompt_filter",
    "reward",
    "tool",
]
