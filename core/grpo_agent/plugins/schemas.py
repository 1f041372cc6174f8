"""Tool JSON schemas derived from type hints and Google-style docstrings.

Design decision: schemas are never written twice; transformers' `get_json_schema` (the format
chat templates consume) reads them from the function. Its parse errors are rewritten into a
message that names the tool and says exactly what to add.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpo_agent.plugins.errors import ToolSchemaError

SCHEMA_FIX = (
    "Add a type hint to every argument and a Google-style docstring with a summary line and an "
    "'Args:' section describing each argument, e.g.\n"
    '    def increment(self, step: int) -> int:\n        """Increment the counter.\n\n'
    '        Args:\n            step: Value to add.\n        """'
)


def tool_schema(fn: Callable, *, owner: str = "") -> dict[str, Any]:
    """The OpenAI-style function schema of a tool; `ToolSchemaError` says what is missing."""
    from transformers.utils import get_json_schema

    label = f"{owner}.{fn.__name__}" if owner else getattr(fn, "__name__", repr(fn))
    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers raises several parsing exception types
        raise ToolSchemaError(f"Tool {label!r} has no usable JSON schema ({err}). {SCHEMA_FIX}") from err


def method_tool_schema(cls: type, method_name: str) -> dict[str, Any]:
    """Schema of an environment method as the model sees it (bound, so without `self`)."""
    function = inspect.getattr_static(cls, method_name)
    bound = function.__get__(object())
    return tool_schema(bound, owner=cls.__name__)


RESERVED_METHODS = frozenset({"reset", "get_reward"})


def public_tool_names(cls: type) -> list[str]:
    """The env's tool methods: public functions except the reserved `reset` / `get_reward`,
    defined on the class or its bases (subclass definitions first). The one rule for both
    registration (`env check`) and rollouts."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") or name in RESERVED_METHODS or name in names:
                continue
            if inspect.isfunction(member):
                names.append(name)
    return names
