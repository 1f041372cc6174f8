"""The spec's rule: everything handed to the spawned rollout worker must pickle.

Checked before anything starts, so a lambda reward fails in a second with its name instead of
minutes later inside a child process.
"""
from __future__ import annotations

import multiprocessing
import pickle
from typing import Any

FIX = (
    "The rollout worker is a spawned process, so these objects are pickled: define them at "
    "module level (lambdas, closures and classes defined inside functions cannot be pickled), "
    "or pass a registered name instead (a reward such as 'accuracy'; an agent registered "
    "through register_agents, or 'pkg.module:attr')."
)


def refuse_trainer_in_spawned_import(what: str = "A trainer") -> None:
    """Refuse to build a trainer while a spawned process re-imports the script that started it.

    The rollout worker is spawned: Python runs the parent's main script again in it (as
    `__mp_main__`) before the worker starts, so a script that builds and trains at its top level
    builds a second trainer there. Python would only stop it at the worker's own spawn, and an
    agent check stops it sooner with a misleading "Cannot pickle ... define them at module
    level" (the script's functions are not defined yet while it is being re-run)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            f"{what} is being built while a spawned process re-imports your main script: the "
            "rollout worker is a spawned process, and Python runs the script that started it "
            "again there, so the script's top level must not build or train. Put the trainer's "
            "construction and train() under `if __name__ == \"__main__\":` (keep rewards, tools "
            "and agents at module level).")


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
