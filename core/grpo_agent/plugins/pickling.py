"""The spec's rule: everything handed to the spawned rollout worker must pickle.

Checked before anything starts, so a lambda reward fails in a second with its name instead of
minutes later inside a child process.
"""
from __future__ import annotations

import pickle
from typing import Any

FIX = (
    "The rollout worker is a spawned process, so these objects are pickled: define them at "
    "module level (lambdas, closures and classes defined inside functions cannot be pickled), "
    "or pass a registered name such as 'accuracy'."
)


def _flatten(name: str, obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, (list, tuple)):
        return [item for i, value in enumerate(obj) for item in _flatten(f"{name}[{i}]", value)]
    if isinstance(obj, dict):
        return [item for key, value in obj.items() for item in _flatten(f"{name}[{key!r}]", value)]
    return [(name, obj)]


def _label(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def check_picklable(named_objects: dict[str, Any]) -> None:
    """Raise one `TypeError` naming every object (inside lists/dicts too) that does not pickle."""
    bad: list[str] = []
    for name, value in named_objects.items():
        for label, obj in _flatten(name, value):
            if obj is None:
                continue
            try:
                pickle.dumps(obj)
            except Exception as err:  # noqa: BLE001 -- pickle raises many exception types
                bad.append(f"{label} = {_label(obj)} ({type(err).__name__}: {err})")
    if bad:
        raise TypeError("Cannot pickle " + "; ".join(bad) + ". " + FIX)
