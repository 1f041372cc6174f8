"""Every env package under envs/ follows the one documented idiom (docs/plugins.md): the env
class is decorated with `@environment(...)` where it is defined, the entry-point module's
`register_environments` hook registers that class, and grpo_agent is imported through its
public API only, so a package keeps working when grpo-agent's internals move."""
from __future__ import annotations

import ast
import importlib
import inspect
import tomllib
from pathlib import Path

import grpo_agent
import pytest
from grpo_agent.plugins import build_registry
from grpo_agent.plugins.decorators import get_marker

ENVS = Path(__file__).parents[2] / "envs"
PACKAGES = sorted(path.parent for path in ENVS.glob("*/pyproject.toml"))
# Public modules besides the top level, documented in docs/plugins.md and docs/agents.md.
PUBLIC_MODULES = {"grpo_agent.sandbox", "grpo_agent.rewards", "grpo_agent.plugins.check"}


def entry_points(package: Path) -> dict[str, str]:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["grpo_agent"]


def test_every_env_package_was_found():
    names = {package.name for package in PACKAGES}
    assert {"grpo-agent-env-coding", "grpo-agent-env-counter", "grpo-agent-env-math"} <= names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_grpo_agent_is_imported_through_its_public_api_only(package):
    for source in package.rglob("*.py"):
        if "tests" in source.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo_agent."):
                assert node.module in PUBLIC_MODULES, (
                    f"{source}:{node.lineno} imports from {node.module}; import from grpo_agent "
                    f"({', '.join(grpo_agent.__all__)}) or {', '.join(sorted(PUBLIC_MODULES))}")
            elif isinstance(node, ast.ImportFrom) and node.module == "grpo_agent":
                private = [a.name for a in node.names if a.name not in grpo_agent.__all__]
                assert not private, f"{source}:{node.lineno}: {private} are not in grpo_agent.__all__"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_the_hook_registers_classes_decorated_where_they_are_defined(package):
    for entry, module_name in entry_points(package).items():
        module = importlib.import_module(module_name)
        registry = build_registry(module)
        envs = [e.obj.factory for e in registry.entries["environment"].values()
                if e.obj.factory.__module__.startswith(module_name.split(".")[0])]
        assert envs, f"entry point {entry} = {module_name} registers no environment"
        for cls in envs:
            marker = get_marker(cls)
            assert marker is not None and marker.kind == "environment", cls
            tree = ast.parse(inspect.getsource(cls))
            decorators = [d.func if isinstance(d, ast.Call) else d for d in tree.body[0].decorator_list]
            assert any(getattr(d, "id", None) == "environment" for d in decorators), (
                f"{cls.__qualname__} is not decorated with @environment(...) where it is defined")
