"""The package's import graph, read statically: no cycle, no import of a later stage.

Every `import grpo_agent...` counts, at module level, inside a function or under
TYPE_CHECKING: a lazy or type-only import still ties two modules together for a reader, and
the lazy ones were how the cycles of issue 16 were hidden.
"""
from __future__ import annotations

import ast
from pathlib import Path

import grpo_agent
import pytest

PACKAGE_DIR = Path(grpo_agent.__file__).parent

# The data flow, turned on its side: a module may import its own stage or an earlier one.
# Top-level modules (types, config, metrics, stall, ...) are the ground floor.
STAGES = {
    "plugins": 1, "demo": 1, "sampler": 1,
    "rollout": 2,
    "train": 3, "weight_sync": 3, "testing": 3,
    "trainer": 4, "cli": 4,
}
FACE = "grpo_agent"  # the package face re-exports everything lazily; nothing imports it

# Cycles still open (none since issue 16); an entry that no longer is a cycle may be deleted.
PENDING_CYCLES: list[set[str]] = []


def module_files(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    found = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` of a submodule
    counts as importing the submodule)."""
    graph = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in files else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def stage(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return max(STAGES.values()) + 1
    return STAGES.get(parts[1], 0)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files())


def test_no_import_cycles(graph):
    found = [c for c in cycles(graph) if not any(c <= pending for pending in PENDING_CYCLES)]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_no_module_imports_a_later_stage_or_the_package_face(graph):
    backward = sorted(f"{module} -> {target}" for module, targets in graph.items()
                      for target in targets if stage(target) > stage(module))
    assert not backward, "imports against the data flow:\n" + "\n".join(backward)


def test_the_checks_see_cycles_and_backward_imports(tmp_path):
    package = tmp_path / "grpo_agent"
    for name, text in {"__init__.py": "", "types.py": "from grpo_agent.rollout import loop\n",
                       "rollout/__init__.py": "", "rollout/loop.py": "import grpo_agent.types\n",
                       "train/__init__.py": "",
                       "train/a.py": "def f():\n    from grpo_agent.train import b\n",
                       "train/b.py": "from grpo_agent.train.a import f\n"}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    toy = import_graph(module_files(package))
    assert sorted(map(sorted, cycles(toy))) == [
        ["grpo_agent.rollout.loop", "grpo_agent.types"], ["grpo_agent.train.a", "grpo_agent.train.b"]]
    assert stage("grpo_agent.rollout.loop") > stage("grpo_agent.types")
