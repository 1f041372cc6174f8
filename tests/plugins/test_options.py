"""Env and plugin options: declaration, typing, binding, and the errors that list valid ones."""
from __future__ import annotations

import json
import pickle

import pytest
from grpo_agent import (
    Option,
    advantage_estimator,
    environment,
    hookimpl,
    load_environment,
    prompt_filter,
    reward,
)
from grpo_agent.plugins import OptionError, PluginError, build_registry
from grpo_agent.plugins.options import bind_options, parse_pairs
from grpo_agent.rollout.scoring import reward_name

SIZE = Option("size", int, 3, "rows in the dataset")
OPTIONS = [
    Option("word", str, "hi", "what to repeat", choices=lambda: ["hi", "yo"]),
    SIZE,
    Option("scale", float, 1.0, "reward multiplier"),
    Option("shout", bool, False, "upper-case the prompt"),
]


def rows(word: str, size: int, **_):
    return [{"prompt": f"{word} {i}"} for i in range(size)]


@environment("repeat", options=OPTIONS, dataset=rows)
class RepeatEnv:
    """Repeat a word; options reach the class as keywords."""

    def __init__(self, word: str, size: int, scale: float, shout: bool):
        self.word, self.scale, self.shout = word, scale, shout

    def reset(self, **row):
        return self.word.upper() if self.shout else self.word


class RepeatPlugin:
    @staticmethod
    @hookimpl
    def register_environments(register):
        register(RepeatEnv)


@pytest.fixture(scope="module")
def registry():
    return build_registry(RepeatPlugin)


def test_text_values_are_typed_by_the_declaration(registry):
    spec = registry.environment_spec("repeat", {"word": "yo", "size": "2", "scale": "0.5", "shout": "true"})
    assert spec.option_values == {"word": "yo", "size": 2, "scale": 0.5, "shout": True}
    env = spec()  # the bound spec is a zero-argument factory
    assert (env.word, env.scale, env.reset()) == ("yo", 0.5, "YO")
    assert spec.load_dataset() == [{"prompt": "yo 0"}, {"prompt": "yo 1"}]


def test_defaults_apply_and_the_factory_pickles_with_its_values(registry):
    spec = registry.environment_spec("repeat")
    assert spec.option_values == {"word": "hi", "size": 3, "scale": 1.0, "shout": False}
    factory = pickle.loads(pickle.dumps(registry.environment_spec("repeat", {"size": 1}).environment_factory))
    assert factory().word == "hi"
    assert registry.resolve_environment("repeat")().reset() == "hi"


def test_python_values_must_have_the_type_ints_are_floats_bools_are_not_ints():
    assert bind_options(OPTIONS, {"scale": 2, "size": 4}, "x") == {
        "word": "hi", "size": 4, "scale": 2.0, "shout": False}
    with pytest.raises(OptionError, match=r"Option 'size' of x takes an int, got True"):
        bind_options(OPTIONS, {"size": True}, "x")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"sise": "2"}, ("Unknown option 'sise' for environment 'repeat'. Did you mean: size? Valid options: "
                        "word (str, default 'hi'): what to repeat; size (int, default 3): rows in the dataset")),
        ({"size": "two"}, "Option 'size' of environment 'repeat' takes an int, got 'two'. Valid options: word"),
        ({"shout": "maybe"}, "Option 'shout' of environment 'repeat' takes a bool, got 'maybe'."),
        ({"word": "yoo"}, ("Option 'word' of environment 'repeat' has no choice 'yoo' (did you mean: yo?); "
                          "choices: hi, yo.")),
    ],
)
def test_bad_options_name_the_problem_and_the_valid_ones(registry, given, message):
    with pytest.raises(OptionError) as err:
        registry.environment_spec("repeat", given)
    assert str(err.value).startswith(message), str(err.value)


def test_an_env_without_options_refuses_any():
    with pytest.raises(OptionError, match="environment 'counter' takes no options, but got 'size'"):
        load_environment("counter", size=3)


def test_pairs_need_key_equals_value():
    assert parse_pairs(["task=a=b", " size = 3"], "--env-arg") == {"task": "a=b", "size": "3"}
    with pytest.raises(OptionError, match="--env-arg 'task': write it as key=value"):
        parse_pairs(["task"], "--env-arg")


def test_a_pair_without_a_key_says_how_to_write_it():
    with pytest.raises(OptionError, match="--env-arg '=3': write it as key=value"):
        parse_pairs(["=3"], "--env-arg")


@prompt_filter("gate", options=[Option("every", int, 2, "keep every n-th row")])
def gate_filter(row_index, row, epoch, *, every):
    return row_index % every == 0


@advantage_estimator("gate", options=[Option("scale", float, 1.0, "advantage multiplier")])
def gate_estimator(group, *, scale):
    return [scale] * len(group.rewards)


class GatePlugin:
    @staticmethod
    @hookimpl
    def register_prompt_filters(register):
        register(gate_filter)

    @staticmethod
    @hookimpl
    def register_advantage_estimators(register):
        register(gate_estimator)


def test_an_option_of_the_unselected_estimator_says_to_select_the_estimator():
    """The other way round from curriculum's: 'gate' is selected as a prompt filter only and
    its estimator's option is given, so the fix is --set advantage_estimator=gate."""
    with pytest.raises(OptionError, match=r"Option 'scale' of plugin 'gate' belongs to its advantage "
                                          r"estimator, .* \(--set advantage_estimator=gate\)"):
        build_registry(GatePlugin).check_plugin_args({"gate": {"scale": "0.5"}},
                                                     {"prompt_filter": ["gate"], "advantage_estimator": []})


@prompt_filter("twin", options=[Option("scale", float, 1.0, "unused")])
def twin_filter(row_index, row, epoch, *, scale):
    return True


@advantage_estimator("twin", options=[Option("scale", float, 1.0, "advantage multiplier")])
def twin_estimator(group, *, scale):
    return [scale] * len(group.rewards)


class TwinPlugin:
    @staticmethod
    @hookimpl
    def register_prompt_filters(register):
        register(twin_filter)

    @staticmethod
    @hookimpl
    def register_advantage_estimators(register):
        register(twin_estimator)


def test_an_option_the_selected_kind_declares_is_accepted_though_an_unselected_kind_has_it_too():
    """Only options the selected objects lack are blamed on an unselected kind."""
    build_registry(TwinPlugin).check_plugin_args({"twin": {"scale": "0.5"}},
                                                 {"prompt_filter": [], "advantage_estimator": ["twin"]})


def test_one_plugin_args_entry_gives_each_object_of_the_name_only_the_options_it_declares():
    from types import SimpleNamespace

    registry = build_registry(GatePlugin)
    args = {"gate": {"every": "3", "scale": "0.5"}}
    registry.check_plugin_args(args, {"prompt_filter": ["gate"], "advantage_estimator": ["gate"]})
    keep = registry.bind_plugin("prompt_filter", "gate", args)
    estimate = registry.bind_plugin("advantage_estimator", "gate", args)
    assert [keep(i, {}, 0) for i in range(4)] == [True, False, False, True]
    assert estimate(SimpleNamespace(rewards=[1.0, 0.0])) == [0.5, 0.5]
    assert registry.bind_plugin("advantage_estimator", "gate", None)(SimpleNamespace(rewards=[1.0])) == [1.0]


@reward("scaled", options=[Option("scale", float, 2.0, "reward multiplier")])
def scaled_reward(completions, *, scale, **kwargs):
    return [scale] * len(completions)


@environment("scaled-env", rewards=["scaled"])
class ScaledEnv:
    """An env scored by a reward that declares an option."""

    def reset(self, **row):
        return "go"


class ScaledPlugin:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register(scaled_reward)

    @staticmethod
    @hookimpl
    def register_environments(register):
        register(ScaledEnv)


def test_a_reward_gets_the_options_it_declares():
    """docs/plugins.md: "An env, reward, advantage estimator or prompt filter declares its options
    ... The values reach ... the plugin function as keyword arguments". A reward's declared
    default must reach it (and `plugin_args` may set it) like a filter's or an estimator's."""
    registry = build_registry(ScaledPlugin)
    completions = [[{"role": "assistant", "content": "a"}]]
    (scaled,) = registry.environment_spec("scaled-env").reward_funcs()
    assert scaled(completions=completions) == [2.0]
    (scaled,) = registry.environment_spec("scaled-env").reward_funcs(plugin_args={"scaled": {"scale": "0.5"}})
    assert scaled(completions=completions) == [0.5]
    assert reward_name(scaled) == "scaled_reward"  # its metrics keep the function's name
    # A reward in use may be configured; an option it does not declare is refused by name.
    used = {"reward": registry.names_of("reward", [scaled])}
    registry.check_plugin_args({"scaled": {"scale": 3}}, used)
    with pytest.raises(OptionError, match="Unknown option 'scal' for plugin 'scaled'. Did you mean: scale"):
        registry.check_plugin_args({"scaled": {"scal": 3}}, used)


def test_the_trainers_rewards_get_their_options_by_name_or_as_decorated_functions(monkeypatch):
    from grpo_agent.train import inputs

    registry = build_registry(ScaledPlugin)
    monkeypatch.setattr(inputs, "load_registry", lambda: registry)
    completions = [[{"role": "assistant", "content": "a"}]] * 2
    for ref in ("scaled", scaled_reward):
        (bound,), _, _ = inputs.resolve_plugins([ref], None, None, {"scaled": {"scale": 4.0}})
        assert bound(completions=completions) == [4.0, 4.0]
    (bound,), _, _ = inputs.resolve_plugins(scaled_reward, None, None)
    assert bound(completions=completions) == [2.0, 2.0]  # the declared default


def test_plugin_args_are_checked_against_the_plugins_in_use():
    from grpo_agent.plugins import load_registry

    registry = load_registry()
    used = {"advantage_estimator": ["curriculum"], "prompt_filter": ["curriculum"]}
    registry.check_plugin_args({"curriculum": {"pass_rate_cap": 0.5}}, used)
    with pytest.raises(OptionError, match=r"Unknown option 'pass_rate' for plugin 'curriculum'\. Did you mean: "
                                          r"pass_rate_cap\? Valid options: pass_rate_cap \(float, default 0.9\)"):
        registry.check_plugin_args({"curriculum": {"pass_rate": 0.5}}, used)
    with pytest.raises(OptionError, match="plugin_args names 'curriculum', which this run does not use. "
                                          "Plugins in use: all, group_norm"):
        registry.check_plugin_args({"curriculum": {"pass_rate_cap": 0.5}},
                                   {"advantage_estimator": ["group_norm"], "prompt_filter": ["all"]})


def test_an_option_of_an_unselected_kind_of_the_plugin_says_which_to_select():
    """Found with `train --set advantage_estimator=curriculum --plugin-arg
    curriculum.pass_rate_cap=0.5`: the error said curriculum "takes no options", while
    `plugins list` shows pass_rate_cap (its prompt filter's option)."""
    from grpo_agent.plugins import load_registry

    with pytest.raises(OptionError, match=r"Option 'pass_rate_cap' of plugin 'curriculum' belongs to its "
                                          r"prompt filter, which this run does not select: select it "
                                          r"\(--set prompt_filters=curriculum\) or remove the option\."):
        load_registry().check_plugin_args({"curriculum": {"pass_rate_cap": 0.5}},
                                          {"advantage_estimator": ["curriculum"], "prompt_filter": []})


# ---- through the CLI -------------------------------------------------------------------------


def test_train_takes_env_and_plugin_options_from_flags_and_run_files(cli, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        'env = "counter"\nmax_steps = 2\nadvantage_estimator = "curriculum"\n'
        'prompt_filters = ["curriculum"]\n[plugin_args.curriculum]\npass_rate_cap = 0.5\n'
    )
    code, out, err = cli("train", "--config", str(run_file), "--dry-run", "--output-dir", str(tmp_path))
    assert code == 0, err
    assert out.startswith("env: counter-v1 [grpo-agent-env-counter]\n")
    assert json.loads(out.split("\n", 2)[2])["plugin_args"] == {"curriculum": {"pass_rate_cap": 0.5}}
    code, out, _ = cli("train", "--config", str(run_file), "--plugin-arg", "curriculum.pass_rate_cap=0.7",
                       "--dry-run", "--output-dir", str(tmp_path))
    assert json.loads(out.split("\n", 2)[2])["plugin_args"] == {"curriculum": {"pass_rate_cap": "0.7"}}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env", "counter", "--env-arg", "size=3"],
         "Error: environment 'counter' takes no options, but got 'size'. Remove it."),
        (["--env", "counter", "--set", 'prompt_filters=["curriculum"]', "--plugin-arg",
          "curriculum.pass_rate_cap=high"],
         ("Error: Option 'pass_rate_cap' of plugin 'curriculum' takes a float, got 'high'. "
         "Valid options: pass_rate_cap (float, default 0.9)")),
        (["--env", "counter", "--plugin-arg", "curriculum=0.5"],
         "Error: --plugin-arg 'curriculum=0.5': write it as name.option=value"),
        ([], "Error: No environment: pass --env NAME or put env = \"NAME\" in the run file."),
    ],
)
def test_option_errors_are_one_line(cli, tmp_path, args, message):
    code, _, err = cli("train", *args, "--dry-run", "--output-dir", str(tmp_path))
    assert code == 1
    assert err.startswith(message), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "advantage_estimator=curiculum"],
         "Error: Unknown advantage estimator 'curiculum'. Did you mean: curriculum?"),
        (["--set", 'prompt_filters=["curiculum"]'],
         "Error: Unknown prompt filter 'curiculum'. Did you mean: curriculum?"),
    ],
)
def test_an_unknown_estimator_or_filter_fails_the_dry_run_not_the_rollout_worker(cli, tmp_path, args, message):
    # Before, the dry run passed and a real run started the server and the model, then failed
    # in the rollout worker with only "The rollout worker failed:" on the terminal.
    code, _, err = cli("train", "--env", "counter", *args, "--dry-run", "--output-dir", str(tmp_path))
    assert code == 1
    assert err.startswith(message), err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"advantage_estimator": "curiculum"}, "Unknown advantage estimator 'curiculum'. Did you mean"),
        ({"prompt_filters": ["curiculum"]}, "Unknown prompt filter 'curiculum'. Did you mean"),
        ({"prompt_filters": ["curriculum"], "plugin_args": {"curriculum": {"pass_rate": 0.8}}},
         "Unknown option 'pass_rate' for plugin 'curriculum'. Did you mean: pass_rate_cap?"),
    ],
)
def test_the_python_trainer_checks_estimator_filters_and_plugin_args_at_construction(
        tiny_model_path, tmp_path, config, message):
    """The docs' `AsyncGRPOConfig(advantage_estimator=..., prompt_filters=..., plugin_args=...)`:
    a typo was accepted by AsyncGRPOTrainer(...) and failed only in the spawned rollout worker,
    after the server probe (the CLI checked it; the Python API did not)."""
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1,
                           vllm_server_base_url="http://127.0.0.1:9", **config)  # never contacted
    with pytest.raises(PluginError, match=message):
        AsyncGRPOTrainer(str(tiny_model_path), reward_funcs=["accuracy"], args=args,
                         train_dataset=[{"prompt": [{"role": "user", "content": "2+2?"}]}])


def test_a_prompt_filter_given_as_text_is_its_name(cli, tmp_path):
    code, out, err = cli("train", "--env", "counter", "--set", "max_steps=1", "--set",
                         "prompt_filters=curriculum", "--plugin-arg", "curriculum.pass_rate_cap=0.5",
                         "--dry-run", "--output-dir", str(tmp_path))
    assert code == 0, err
    assert json.loads(out.split("\n", 2)[2])["prompt_filters"] == ["curriculum"]


def test_plugins_list_shows_plugin_options(cli):
    code, out, _ = cli("plugins", "list")
    assert code == 0
    assert "--plugin-arg curriculum.pass_rate_cap (float, default 0.9)" in out


def test_the_rollout_loop_resolves_plugins_with_their_options():
    from types import SimpleNamespace

    from grpo_agent.rollout.plugins import check_plugin_args, resolve_prompt_filters

    keep = resolve_prompt_filters(["curriculum"], {"curriculum": {"pass_rate_cap": 0.0}})[0]
    assert keep(12345, {}, 0) is False  # cap 0: even an unseen prompt (pass rate 0) is skipped
    assert resolve_prompt_filters(["curriculum"])[0](12345, {}, 0) is True
    config = SimpleNamespace(plugin_args={"curriculum": {"pass_rate_cap": "x"}},
                             advantage_estimator="group_norm", prompt_filters=["curriculum"])
    with pytest.raises(OptionError, match="Option 'pass_rate_cap' of plugin 'curriculum' takes a float"):
        check_plugin_args(config)


def test_a_declaration_with_a_default_of_the_wrong_type_fails_at_import():
    with pytest.raises(TypeError, match="Option 'size': default '3' is not a int"):
        Option("size", int, "3")
    with pytest.raises(TypeError, match="type must be one of str, int, float, bool"):
        Option("rows", list, [])


def _registering(kind: str, obj):
    hook = f"register_{kind}"
    plugin = type("OnePlugin", (), {hook: staticmethod(hookimpl(specname=hook)(lambda register: register(obj)))})
    return lambda: build_registry(plugin)


def rows_without_options():
    return [{"prompt": "hi"}]


@environment("needy", options=[SIZE])
class EnvWithoutTheOption:
    """Declares `size` but its constructor does not take it."""

    def reset(self, **row):
        return "hi"


@environment("greedy")
class EnvRequiringAnArgument:
    """Requires `size`, which no option gives."""

    def __init__(self, size: int):
        self.size = size

    def reset(self, **row):
        return "hi"


@environment("sloppy", options=[SIZE], dataset=rows_without_options)
class EnvWhoseDatasetLacksTheOption:
    """Its class takes the option, its dataset function does not."""

    def __init__(self, size: int):
        self.size = size

    def reset(self, **row):
        return "hi"


@reward("scaled_without_scale", options=[Option("scale", float, 1.0, "multiplier")])
def reward_without_its_option(completions, **kwargs_without_scale):
    return [1.0] * len(completions)


@prompt_filter("cap_without_cap", options=[Option("cap", float, 0.9, "cap")])
def filter_without_its_option(row_index, row, epoch):
    return True


@pytest.mark.parametrize(("kind", "obj", "message"), [
    ("environments", EnvWithoutTheOption, (r"The class EnvWithoutTheOption of environment 'needy' \(from "
     r".*\) does not take its declared option\(s\) size: every option arrives as a keyword argument, so "
     r"add a parameter for each \(or \*\*_ to ignore them\)\.")),
    ("environments", EnvRequiringAnArgument, (r"The class EnvRequiringAnArgument of environment 'greedy' "
     r".* requires size, which no declared option gives: declare each with Option\(name, type, "
     r"default, help\) in @environment\(options=\[\.\.\.\]\), or give it a default\.")),
    ("environments", EnvWhoseDatasetLacksTheOption, (r"The dataset function of environment 'sloppy' .* "
     r"does not take its declared option\(s\) size")),
    ("prompt_filters", filter_without_its_option, (r"The prompt filter 'cap_without_cap' .* does not take "
     r"its declared option\(s\) cap")),
])
def test_an_object_that_cannot_take_its_options_is_refused_at_registration(kind, obj, message):
    """Such an env failed only in the run, in every rollout (`TypeError: VarEnv.__init__() got
    an unexpected keyword argument 'size'`), and `train --dry-run` passed; now `env list`,
    `env check` and `train` refuse it at start-up, naming it and the fix."""
    with pytest.raises(OptionError, match=message):
        _registering(kind, obj)()


def test_objects_that_take_their_options_by_keyword_or_by_kwargs_register():
    registry = _registering("rewards", reward_without_its_option)()  # **kwargs takes `scale`
    assert registry.resolve_reward("scaled_without_scale") is reward_without_its_option
    assert build_registry(RepeatPlugin).environment_spec("repeat").factory is RepeatEnv  # by keyword
