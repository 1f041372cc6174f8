"""Entry-point loading: GRPO_AGENT_LOAD_PLUGINS and plugins that fail to import."""
from __future__ import annotations

import json
from importlib.metadata import PathDistribution

import pytest
from grpo_agent.plugins import DuplicateNameError, PluginError, PluginImportError, manager


def _fake_distribution(tmp_path, module: str):
    """A real on-disk dist-info whose entry point names a module that cannot be imported."""
    info = tmp_path / "grpo_agent_broken-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-agent-broken\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text(f"[grpo_agent]\nbroken = {module}\n")
    return PathDistribution(info)


def test_plugin_that_fails_to_import_names_its_distribution_and_error(tmp_path, monkeypatch):
    dist = _fake_distribution(tmp_path, "grpo_agent_no_such_module_xyz")
    monkeypatch.setattr(manager, "entry_points", lambda group: list(dist.entry_points))
    monkeypatch.delenv(manager.LOAD_ENV, raising=False)
    with pytest.raises(PluginImportError) as err:
        manager.build_plugin_manager()
    message = str(err.value)
    assert "Plugin 'broken' from distribution grpo-agent-broken 9.9 failed to import" in message
    assert "ModuleNotFoundError: No module named 'grpo_agent_no_such_module_xyz'" in message
    assert "pip uninstall grpo-agent-broken" in message
    # GRPO_AGENT_LOAD_PLUGINS lists what loads; "skip it with" read as if it listed what not to.
    assert message.endswith("or leave it out by naming the plugins to load: "
                            "GRPO_AGENT_LOAD_PLUGINS=NAME,... (entry-point or distribution names).")


def test_load_plugins_variable_limits_what_loads(tmp_path, monkeypatch):
    dist = _fake_distribution(tmp_path, "grpo_agent_no_such_module_xyz")
    monkeypatch.setattr(manager, "entry_points", lambda group: list(dist.entry_points))
    monkeypatch.setenv(manager.LOAD_ENV, "")
    pm = manager.build_plugin_manager()  # the broken plugin is not even imported
    assert [name for name, _ in pm.list_name_plugin()] == list(manager.BUILTIN_MODULES)
    monkeypatch.setenv(manager.LOAD_ENV, "grpo-agent-broken")
    with pytest.raises(PluginImportError):
        manager.build_plugin_manager()


def test_installed_first_party_plugins_are_discovered(monkeypatch):
    monkeypatch.setenv(manager.LOAD_ENV, "counter,math,curriculum")
    registry = manager.load_registry()
    assert {"counter-v1", "math-v1"} <= set(registry.environments)
    assert registry.distribution_of("environment", "counter") == "grpo-agent-env-counter"
    assert "curriculum" in registry.prompt_filters
    assert manager.load_registry() is registry  # cached per process


def _dist_with(tmp_path, dist_name: str, entry_point: str):
    info = tmp_path / f"{dist_name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[grpo_agent]\n{entry_point}\n")
    return PathDistribution(info)


def test_two_distributions_with_one_plugin_name_are_both_named(tmp_path, monkeypatch):
    first = _dist_with(tmp_path, "grpo-agent-first", "dup = grpo_agent_env_counter")
    second = _dist_with(tmp_path, "grpo-agent-second", "dup = grpo_agent_env_math")
    monkeypatch.setattr(manager, "entry_points",
                        lambda group: [*first.entry_points, *second.entry_points])
    monkeypatch.delenv(manager.LOAD_ENV, raising=False)
    with pytest.raises(DuplicateNameError) as err:
        manager.build_plugin_manager()
    assert str(err.value) == (
        "Plugin name 'dup' is used twice: by grpo-agent-first and by grpo-agent-second. "
        "Uninstall one of them."
    )


def test_load_plugins_names_may_have_spaces_around_the_commas(tmp_path, monkeypatch):
    first = _dist_with(tmp_path, "grpo-agent-first", "first = grpo_agent_env_counter")
    second = _dist_with(tmp_path, "grpo-agent-second", "second = grpo_agent_env_math")
    monkeypatch.setattr(manager, "entry_points",
                        lambda group: [*first.entry_points, *second.entry_points])
    monkeypatch.setenv(manager.LOAD_ENV, " first , grpo-agent-second ,")
    assert [ep.name for ep in manager.installed_entry_points()] == ["first", "second"]


def test_a_plugin_raising_any_error_at_import_names_its_distribution(tmp_path, monkeypatch):
    """Not only ImportError: a plugin's module may fail with any exception while it loads."""
    (tmp_path / "grpo_agent_raises_xyz.py").write_text("raise RuntimeError('no config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dist = _fake_distribution(tmp_path, "grpo_agent_raises_xyz")
    monkeypatch.setattr(manager, "entry_points", lambda group: list(dist.entry_points))
    monkeypatch.delenv(manager.LOAD_ENV, raising=False)
    with pytest.raises(PluginImportError, match="Plugin 'broken' from distribution grpo-agent-broken 9.9 "
                                                "failed to import .*RuntimeError: no config file"):
        manager.build_plugin_manager()


def test_a_load_plugins_name_that_no_plugin_has_is_an_error_with_the_close_match(tmp_path, monkeypatch):
    # Before, a typo loaded nothing: `env check counter` then said "Unknown environment
    # 'counter' ... Install the plugin that provides it", though it was installed.
    first = _dist_with(tmp_path, "grpo-agent-first", "first = grpo_agent_env_counter")
    monkeypatch.setattr(manager, "entry_points", lambda group: list(first.entry_points))
    monkeypatch.setenv(manager.LOAD_ENV, "frist")
    with pytest.raises(PluginError) as err:
        manager.installed_entry_points()
    assert str(err.value) == (
        "GRPO_AGENT_LOAD_PLUGINS names 'frist' (did you mean 'first'?), which no installed plugin has. "
        "Installed plugins (entry-point names and distributions): first, grpo-agent-first.")


def test_plugins_list_warns_of_a_plugin_that_implements_no_hook(tmp_path, monkeypatch, cli, caplog):
    """A plugin package whose module marks an env but forgot its register hook was listed as
    `hooks: (none)` without a word, and a run asking for the env got "Unknown environment"."""
    (tmp_path / "grpo_agent_forgot_xyz.py").write_text(
        "from grpo_agent import environment\n\n\n"
        "@environment('forgot')\nclass ForgotEnv:\n"
        "    def reset(self, **row):\n        return 'hi'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dist = _dist_with(tmp_path, "grpo-agent-forgot", "forgot = grpo_agent_forgot_xyz")
    monkeypatch.setattr(manager, "entry_points", lambda group: list(dist.entry_points))
    monkeypatch.setenv(manager.LOAD_ENV, "forgot")
    manager.clear_cache()
    try:
        code, out, _ = cli("plugins", "list")
        _, as_json, _ = cli("plugins", "list", "--json")
    finally:
        manager.clear_cache()
    expected = (
        "Plugin 'forgot' from distribution grpo-agent-forgot 1.0 implements no hook, so it "
        "registers nothing; its module marks environment ForgotEnv but never registers them. "
        "Register what it provides in its module: `from grpo_agent import hookimpl`, then "
        "`@hookimpl` above `def register_environments(register): register(ForgotEnv)`. Fix or "
        "uninstall it (pip uninstall grpo-agent-forgot), or leave it out by naming the plugins "
        "to load: GRPO_AGENT_LOAD_PLUGINS=NAME,... (entry-point or distribution names).")
    assert code == 0
    assert f"    hooks: (none)\n    warning: {expected}\n" in out, out
    rows = {row["name"]: row for row in json.loads(as_json)}
    assert rows["forgot"]["problem"] == expected
    assert rows["grpo_agent.plugins.builtins"]["problem"] is None
    assert expected in caplog.text  # the registry build says it too, for a run's log


def test_a_plugin_with_no_hook_and_no_marked_object_is_told_how_to_write_one():
    from types import ModuleType

    plugin = ModuleType("grpo_agent_empty_xyz")
    registry = manager.build_registry(plugin)
    row = next(row for row in registry.plugins if row["name"] == "grpo_agent_empty_xyz")
    assert row["problem"].startswith(
        "Plugin 'grpo_agent_empty_xyz' from test plugin grpo_agent_empty_xyz implements no hook, "
        "so it registers nothing. Register what it provides in its module: `from grpo_agent "
        "import hookimpl`, then `@hookimpl` above a registration hook such as `def "
        "register_environments(register): register(MyEnv)`."), row
