"""docs/plugins.md documents every hookspec with its arguments."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from grpo_agent.plugins import hookspecs

DOC = (Path(__file__).parents[2] / "docs" / "plugins.md").read_text()
SPECS = [
    name for name, fn in vars(hookspecs).items()
    if inspect.isfunction(fn) and hasattr(fn, f"{hookspecs.PROJECT_NAME}_spec")
]


def test_hookspecs_were_found():
    assert len(SPECS) == 7


@pytest.mark.parametrize("name", SPECS)
def test_every_hookspec_is_documented_with_its_arguments(name):
    arguments = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    assert f"### `{name}({arguments})`" in DOC, f"docs/plugins.md lacks a section for {name}"
