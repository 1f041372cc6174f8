"""The plugin host on plugin objects registered in-process (no installed entry points)."""
from __future__ import annotations

import pytest
from grpo_agent import advantage_estimator, environment, hookimpl, prompt_filter, reward, tool
from grpo_agent.plugins import (
    DuplicateNameError,
    PluginError,
    ToolSchemaError,
    UnknownNameError,
    build_registry,
)
from grpo_agent.plugins.decorators import get_marker
from grpo_agent.plugins.registry import Registry, environment_spec_from_class


@reward("length")
def length_reward(completions, **kwargs):
    return [float(len(c[-1]["content"])) for c in completions]


@tool
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: First number.
        b: Second number.
    """
    return a + b


@environment("echo", version=2, rewards=["length"])
class EchoEnvV2:
    """Repeat what you are told."""

    def reset(self, **row):
        return "Say hi."

    def say(self, text: str) -> str:
        """Say something.

        Args:
            text: What to say.
        """
        return text


@environment("echo", version=1)
class EchoEnvV1(EchoEnvV2):
    """The first version."""


class SamplePlugin:
    __name__ = "sample"

    @hookimpl
    def register_rewards(self, register):
        register(length_reward)

    @hookimpl
    def register_tools(self, register):
        register(add)

    @hookimpl
    def register_environments(self, register):
        register(EchoEnvV1)
        register(EchoEnvV2)

    @hookimpl
    def register_advantage_estimators(self, register):
        register(advantage_estimator("zeros")(lambda group: [0.0] * len(group.rewards)))

    @hookimpl
    def register_prompt_filters(self, register):
        register(prompt_filter("even")(lambda i, row, epoch: i % 2 == 0))


def test_decorators_mark_and_return_the_object_unchanged():
    assert get_marker(add).kind == "tool" and get_marker(add).name is None
    assert get_marker(length_reward).name == "length"
    assert length_reward([[{"content": "abc"}]]) == [3.0]
    assert get_marker(EchoEnvV2).options["version"] == 2


def test_hooks_resolve_into_plain_dicts_with_builtins():
    registry = build_registry(SamplePlugin())
    assert {"accuracy", "format", "length"} <= set(registry.rewards)
    assert registry.tools["add"] is add
    assert {"echo-v1", "echo-v2"} <= set(registry.environments)
    assert {"group_norm", "zeros"} <= set(registry.advantage_estimators)
    assert {"all", "even"} <= set(registry.prompt_filters)
    assert registry.distribution_of("reward", "length") == "test plugin sample"


def test_unversioned_env_name_resolves_to_the_latest_version():
    registry = build_registry(SamplePlugin())
    assert registry.resolve_environment("echo") is EchoEnvV2
    assert registry.resolve_environment("echo-v1") is EchoEnvV1
    assert registry.environment_spec("echo").rewards == ["length"]
    assert registry.resolve_environment({"a": "echo-v1", "b": EchoEnvV2}) == {
        "a": EchoEnvV1, "b": EchoEnvV2}


def test_a_spec_resolves_its_reward_names_in_the_registry_it_came_from():
    import pickle

    spec = build_registry(SamplePlugin()).environment_spec("echo")
    assert spec.reward_funcs() == [length_reward]  # "length" is not in the installed plugins
    copy = pickle.loads(pickle.dumps(spec))  # what the worker gets: the spec, not every plugin
    assert copy.registry is None and copy().reset() == "Say hi."
    with pytest.raises(ValueError, match=r"names its rewards \['length'\].*reward_funcs\("):
        copy.reward_funcs()
    assert copy.reward_funcs(build_registry(SamplePlugin())) == [length_reward]


def test_names_and_import_paths_resolve_and_callables_pass_through():
    registry = build_registry(SamplePlugin())
    assert registry.resolve_reward("length") is length_reward
    assert registry.resolve_reward("grpo_agent.rewards:accuracy_reward").__name__ == "accuracy_reward"
    assert registry.resolve_reward(len) is len
    assert registry.resolve_prompt_filter("even")(2, {}, 0) is True
    assert registry.resolve_environment(f"{__name__}:EchoEnvV1") is EchoEnvV1


def test_unknown_name_lists_close_matches_and_installed_names():
    registry = build_registry(SamplePlugin())
    with pytest.raises(UnknownNameError) as err:
        registry.resolve_reward("accurcy")
    message = str(err.value)
    assert "Unknown reward 'accurcy'. Did you mean: accuracy?" in message
    assert f"Installed rewards: {', '.join(sorted(registry.rewards))}." in message
    assert "length" in registry.rewards
    with pytest.raises(UnknownNameError, match="Unknown environment 'ecko'. Did you mean: echo"):
        registry.resolve_environment("ecko")


def test_bad_import_path_names_module_and_attribute():
    registry = build_registry()
    with pytest.raises(PluginError, match="Module 'grpo_agent.rewards' has no attribute 'nope'"):
        registry.resolve_reward("grpo_agent.rewards:nope")


class DuplicatePlugin:
    __name__ = "duplicate"

    @hookimpl
    def register_rewards(self, register):
        register(length_reward, name="accuracy")


def test_duplicate_name_names_both_distributions():
    with pytest.raises(DuplicateNameError) as err:
        build_registry(DuplicatePlugin())
    assert str(err.value).startswith(
        "The reward name 'accuracy' is registered twice: by grpo-agent (built-in) and by "
        "test plugin duplicate."
    )
    assert str(err.value).endswith("or leave one out by naming the plugins to load: "
                                   "GRPO_AGENT_LOAD_PLUGINS=NAME,... (entry-point or distribution names).")


def undocumented(x):
    return x


class NoSchemaPlugin:
    __name__ = "noschema"

    @hookimpl
    def register_tools(self, register):
        register(undocumented)


def test_tool_without_hints_or_docstring_says_what_to_add():
    with pytest.raises(ToolSchemaError) as err:
        build_registry(NoSchemaPlugin())
    message = str(err.value)
    assert "Tool 'undocumented' has no usable JSON schema" in message
    assert "Add a type hint to every argument and a Google-style docstring" in message


class UndocumentedEnv:
    def reset(self, **row):
        return "go"

    def move(self, steps):
        return steps


class BadEnvPlugin:
    __name__ = "badenv"

    @hookimpl
    def register_environments(self, register):
        register(UndocumentedEnv, name="bad")


def test_env_tool_method_without_schema_is_reported_by_class_and_method():
    with pytest.raises(ToolSchemaError, match="Tool 'UndocumentedEnv.move' has no usable JSON schema"):
        build_registry(BadEnvPlugin())


def test_a_tool_without_a_schema_names_the_plugin_and_distribution_that_registered_it():
    """The error named only the tool ('undocumented', 'UndocumentedEnv.move'): with several
    plugins installed, nothing said which one to fix or skip."""
    from grpo_agent.plugins import manager

    with pytest.raises(ToolSchemaError, match=r"^Plugin 'noschema' from test plugin noschema, in its "
                                              r"register_tools hook: Tool 'undocumented' has no"):
        build_registry(NoSchemaPlugin())
    with pytest.raises(ToolSchemaError, match=r"^Plugin 'badenv' from test plugin badenv, in its "
                                              r"register_environments hook: Tool 'UndocumentedEnv"):
        build_registry(BadEnvPlugin())
    pm = manager.PluginManager()
    pm.add_hookspecs(manager.hookspecs)
    manager._register(pm, NoSchemaPlugin(), "noschema", "grpo-agent-noschema", "1.0")
    with pytest.raises(ToolSchemaError) as err:
        manager.resolve_hooks(pm)
    message = str(err.value)
    assert message.startswith("Plugin 'noschema' from distribution grpo-agent-noschema 1.0, in its "
                              "register_tools hook: Tool 'undocumented'"), message
    assert message.endswith("Fix or uninstall it (pip uninstall grpo-agent-noschema), or leave it out "
                            "by naming the plugins to load: GRPO_AGENT_LOAD_PLUGINS=NAME,... "
                            "(entry-point or distribution names)."), message


class MisspelledPlugin:
    __name__ = "misspelled"

    @hookimpl
    def register_reward(self, register):
        register(length_reward)


def test_misspelled_hook_implementation_is_an_error_with_suggestion():
    with pytest.raises(PluginError) as err:
        build_registry(MisspelledPlugin())
    message = str(err.value)
    assert "Plugin 'misspelled' from test plugin misspelled implements unknown hooks" in message
    assert "'register_reward' (did you mean 'register_rewards'?)" in message


class HalfMisspelledPlugin:
    __name__ = "halfmisspelled"

    @hookimpl
    def register_rewards(self, register):
        register(length_reward)

    @hookimpl
    def register_tool(self, register):
        register(add)


def test_only_the_misspelled_hooks_are_named_unknown():
    with pytest.raises(PluginError) as err:
        build_registry(HalfMisspelledPlugin())
    unknown = str(err.value).split("implements unknown hooks: ")[1].split(". Known hooks:")[0]
    assert unknown == "'register_tool' (did you mean 'register_tools'?)"


class UnmarkedPlugin:
    __name__ = "unmarked"

    def register_rewards(self, register):  # the mistake: no @hookimpl
        register(length_reward)


def test_a_hook_without_hookimpl_is_an_error_saying_to_decorate_it():
    """pluggy never calls it, so its names were "Unknown reward 'length' ... Install the plugin
    that provides it" although the plugin was installed."""
    with pytest.raises(PluginError) as err:
        build_registry(UnmarkedPlugin())
    assert str(err.value) == (
        "Plugin 'unmarked' from test plugin unmarked defines register_rewards without @hookimpl, "
        "so it is never called. Decorate it: `from grpo_agent import hookimpl`, then `@hookimpl` "
        "above `def register_rewards(...)`.")


class WrongArgumentPlugin:
    __name__ = "wrongarg"

    @hookimpl
    def register_rewards(self, reg):
        reg(length_reward)


def test_a_hook_with_a_wrongly_named_argument_says_which_argument_the_hook_passes():
    """It was pluggy's PluginValidationError as a traceback from every command (`env list`
    included), naming neither the distribution nor the argument to take."""
    with pytest.raises(PluginError) as err:
        build_registry(WrongArgumentPlugin())
    message = str(err.value)
    assert message.startswith("Plugin 'wrongarg' from test plugin wrongarg implements a hook with "
                              "arguments it is not called with: register_rewards(reg) should be "
                              "register_rewards(register)."), message


class MissingArgumentPlugin:
    __name__ = "noarg"

    @hookimpl
    def register_rewards(self):
        register(length_reward)  # noqa: F821 -- the mistake: the argument was left out


class RaisingHookPlugin:
    __name__ = "raising"

    @hookimpl
    def register_environments(self, register):
        raise RuntimeError("dataset server down")


def test_a_hook_that_raises_names_its_plugin_hook_and_error():
    """A hook raising (here a NameError: the hook left out its `register` argument) was a bare
    traceback from every command, naming neither the plugin nor its distribution."""
    with pytest.raises(PluginError) as err:
        build_registry(MissingArgumentPlugin())
    assert str(err.value) == (
        "Plugin 'noarg' from test plugin noarg raised in its register_rewards hook: NameError: "
        "name 'register' is not defined. Define it as register_rewards(register): the hook passes "
        "'register'. Fix it.")
    with pytest.raises(PluginError, match=r"^Plugin 'raising' from test plugin raising raised in "
                                          r"its register_environments hook: RuntimeError: dataset "
                                          r"server down\. Fix it\.$"):
        build_registry(RaisingHookPlugin())


def test_an_installed_plugin_with_a_broken_hook_says_how_to_skip_it(monkeypatch):
    from grpo_agent.plugins import manager

    pm = manager.PluginManager()
    pm.add_hookspecs(manager.hookspecs)
    with pytest.raises(PluginError) as err:
        manager._register(pm, WrongArgumentPlugin(), "wrongarg", "grpo-agent-wrong", "1.0")
    assert "Plugin 'wrongarg' from distribution grpo-agent-wrong 1.0 implements" in str(err.value)
    assert str(err.value).endswith("Fix or uninstall it (pip uninstall grpo-agent-wrong), or leave it "
                                   "out by naming the plugins to load: GRPO_AGENT_LOAD_PLUGINS=NAME,... "
                                   "(entry-point or distribution names).")


def test_an_object_without_a_name_is_refused_naming_the_distribution():
    import functools

    register = Registry().register_callable("reward", "grpo-agent-nameless")
    with pytest.raises(PluginError, match="grpo-agent-nameless registered a reward without a name: "
                                          "functools.partial"):
        register(functools.partial(length_reward))


def test_an_env_alias_is_no_name_of_the_other_kinds():
    registry = build_registry(SamplePlugin())
    with pytest.raises(UnknownNameError, match="Unknown reward 'echo'"):
        registry.resolve_reward("echo")


class Resetless:
    """No reset method."""


def test_an_environment_must_be_a_class_with_reset():
    message = "x registered .* as an environment, but an environment must be a class with a reset"
    with pytest.raises(PluginError, match=message):
        environment_spec_from_class(Resetless, None, "x")
    with pytest.raises(PluginError, match=message):
        environment_spec_from_class(EchoEnvV2(), None, "x")


def test_the_name_given_to_register_wins_over_the_decorators_and_the_docstring_describes():
    spec = environment_spec_from_class(EchoEnvV2, "shout", "x")
    assert (spec.name, spec.id) == ("shout", "shout-v2")
    assert environment_spec_from_class(EchoEnvV2, None, "x").id == "echo-v2"
    assert spec.description == "Repeat what you are told."  # the docstring's first line


def test_a_decorator_given_a_non_string_name_says_what_it_takes():
    with pytest.raises(TypeError, match=r"@reward\(...\) takes a name string, got 3"):
        reward(3)


def test_env_tools_are_the_public_functions_of_the_class_and_its_bases():
    class Base:
        def reset(self, **row):
            return "go"

        def get_reward(self) -> float:
            return 0.0

        def base_tool(self, x: int) -> int:
            """Base.

            Args:
                x: A number.
            """
            return x

    class Env(Base):
        Helper = dict  # a class attribute, not a method
        limit = property(lambda self: 3)

        def own_tool(self, y: int) -> int:
            """Own.

            Args:
                y: A number.
            """
            return y

        def _private(self):
            return None

        @staticmethod
        def helper():
            return None

    spec = environment_spec_from_class(Env, "tools", "x")
    assert spec.tool_names == ["own_tool", "base_tool"]
    assert [s["function"]["name"] for s in spec.tool_schemas()] == ["own_tool", "base_tool"]


def test_trainer_resolves_reward_tool_and_environment_names(monkeypatch):
    """AsyncGRPOTrainer accepts registered names (and import paths) for every plugin kind."""
    import operator

    from grpo_agent.train import inputs
    from grpo_agent.train.inputs import resolve_plugins as _resolve_plugins

    registry = build_registry(SamplePlugin())
    monkeypatch.setattr(inputs, "load_registry", lambda: registry)
    rewards, tools, envs = _resolve_plugins(
        ["length"], ["add", "operator:mul"], {"a": "echo", "b": EchoEnvV1}
    )
    assert rewards == [length_reward] and tools == [add, operator.mul]
    assert envs == {"a": EchoEnvV2, "b": EchoEnvV1}  # a bare name picks the newest version
    with pytest.raises(UnknownNameError, match="ad"):
        _resolve_plugins([], ["mul"], None)
