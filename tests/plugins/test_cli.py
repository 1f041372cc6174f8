"""The `grpo-agent` CLI: commands, config parsing and one-line errors."""
from __future__ import annotations

import json

import pytest
import typer
from grpo_agent import hookimpl


def test_version(cli):
    from grpo_agent import __version__

    assert cli("--version") == (0, f"grpo-agent {__version__}\n", "")


def test_plugins_list_shows_distribution_version_and_registrations(cli):
    code, out, _ = cli("plugins", "list", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0
    builtins = rows["grpo_agent.plugins.builtins"]
    assert builtins["distribution"] == "grpo-agent (built-in)"
    assert builtins["registered"]["reward"] == ["accuracy", "format"]
    assert rows["counter"]["distribution"] == "grpo-agent-env-counter"
    assert rows["counter"]["registered"] == {"environment": ["counter-v1"]}
    assert rows["counter"]["version"] == "0.1.0"


def test_env_list_and_show(cli):
    code, out, _ = cli("env", "list")
    assert code == 0
    assert "counter-v1 (alias counter)  [grpo-agent-env-counter]" in out
    code, out, _ = cli("env", "show", "math")
    assert code == 0
    assert "reward sources: accuracy" in out
    assert "dataset: 48 rows, columns: prompt, solution" in out
    assert "eval split: none (grpo-agent eval and --set eval_strategy need one" in out
    code, out, _ = cli("env", "show", "counter")
    assert "reward sources: get_reward (env)" in out
    # The refusal of an env without an eval split sends users here to find one.
    assert "eval split: 9 rows, a rollout passes at summed reward >= 1" in out
    assert '"name": "increment"' in out and '"description": "Value to add to the counter."' in out


@pytest.mark.parametrize(("name", "options"), [
    ("counter", []), ("math", []), ("coding", []), ("coding", ["--env-arg", "suite=humaneval"]),
    ("textarena", []), ("textarena", ["--env-arg", "game=TowerOfHanoi-v0-medium"]),
])
def test_env_check_passes_for_first_party_envs(cli, name, options):
    code, out, _ = cli("env", "check", name, *options)
    assert code == 0, out
    assert "gold answer row 0: reward 1.0" in out
    assert f"env check {name}: all" in out and "FAIL" not in out


def test_unknown_env_is_one_line_with_suggestions(cli):
    code, _, err = cli("env", "show", "countr")
    assert code == 1
    assert err.startswith("Error: Unknown environment 'countr'. Did you mean: counter")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_config_show_merges_run_file_then_set_overrides(cli, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('num_generations = 4\nlearning_rate = 1e-5\nprompt_filters = ["all"]\n')
    code, out, _ = cli(
        "config", "show", "--config", str(run_file), "--set", "learning_rate=3e-6",
        "--set", "score_centering=false",
    )
    config = json.loads(out)
    assert code == 0
    assert config["num_generations"] == 4 and config["learning_rate"] == 3e-6
    assert config["score_centering"] is False and config["prompt_filters"] == ["all"]


def test_a_run_files_parallelism_config_table_is_shown(cli, tmp_path):
    # the table reached the config as a dict: `config show` failed with a traceback
    # (AttributeError: 'dict' object has no attribute 'to_json')
    run_file = tmp_path / "run.toml"
    run_file.write_text("[parallelism_config]\ndp_shard_size = 1\n")
    code, out, err = cli("config", "show", "--config", str(run_file))
    assert code == 0, err
    assert json.loads(out)["parallelism_config"]["dp_shard_size"] == 1


def test_yaml_run_file_is_read(cli, tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("max_staleness: 2\n")
    code, out, _ = cli("config", "show", "--config", str(run_file))
    assert code == 0 and json.loads(out)["max_staleness"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "num_generatons=4"],
         "Error: Unknown config field 'num_generatons'. Did you mean: num_generations"),
        (["--set", "max_steps"], "Error: --set 'max_steps': write it as key=value"),
        (["--set", "num_generations=1"], "Error: num_generations=1: group-normalised advantages"),
        (["--set", "vllm_server_timeout=Infinity"],  # was an OverflowError traceback
         "Error: vllm_server_timeout=inf, rollout_worker_timeout=300.0, stall_timeouts={}: the process"),
        (["--config", "missing.toml"], "Error: Config file missing.toml does not exist."),
        # A value of the wrong type was kept as text, shown by `config show` and `--dry-run`,
        # and only failed (or not) somewhere inside a run.
        (["--set", "max_steps=ten"], "Error: Config field 'max_steps' takes an integer, got 'ten'."),
        (["--set", "learning_rate=fast"], "Error: Config field 'learning_rate' takes a number, got 'fast'."),
        (["--set", "gradient_checkpointing=yes"],
         "Error: Config field 'gradient_checkpointing' takes true or false, got 'yes'."),
        (["--set", "token_budget=big"],
         "Error: Config field 'token_budget' takes an integer (or null), got 'big'."),
        # A dict field's JSON with a lost brace was kept as text and failed only in the rollouts
        # (json.loads of chat_template_kwargs); a number failed as an AttributeError traceback.
        (["--set", 'chat_template_kwargs={"enable_thinking": false'],
         ("Error: Config field 'chat_template_kwargs' takes a JSON object, got "
          "'{\"enable_thinking\": false' (not valid JSON: Expecting ',' delimiter")),
        (["--set", "model_init_kwargs=dtype=float32"],
         "Error: Config field 'model_init_kwargs' takes a JSON object, got 'dtype=float32'"),
        (["--set", "stall_timeouts=5"],
         ("Error: Config field 'stall_timeouts' takes a JSON object, got 5 (int). Quote the whole "
          "pair for the shell, e.g. --set 'stall_timeouts={\"name\": value}'.")),
    ],
)
def test_config_errors_are_one_line(cli, args, message):
    code, _, err = cli("config", "show", *args)
    assert code == 1
    assert err.startswith(message), err


def test_train_dry_run_resolves_env_and_config(cli, tmp_path):
    code, out, _ = cli(
        "train", "--env", "counter", "--set", "max_steps=3", "--output-dir",
        str(tmp_path / "run"), "--dry-run",
    )
    assert code == 0
    assert out.startswith("env: counter-v1 [grpo-agent-env-counter]\n")
    config = json.loads(out.split("\n", 2)[2])
    assert config["max_steps"] == 3 and config["output_dir"] == str(tmp_path / "run")



@pytest.mark.parametrize(("temperature", "warned"), [("0", True), ("0.7", False)])
def test_train_dry_run_gives_the_greedy_warning_of_a_real_start(cli, tmp_path, caplog,
                                                                  temperature, warned):
    # The real start warned that temperature=0 drops every group of a deterministic env; the
    # dry run, where a user checks a run before starting it, printed the config and said nothing.
    from grpo_agent.train.no_progress import GREEDY_CAUSE

    code, _, err = cli("train", "--env", "counter", "--set", f"temperature={temperature}",
                       "--set", "max_steps=1",
                       "--output-dir", str(tmp_path / "run"), "--dry-run")
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(GREEDY_CAUSE in message for message in warnings) is warned, warnings


def test_train_dry_run_shows_the_lora_adapter(cli, tmp_path):
    code, out, _ = cli(
        "train", "--env", "counter", "--set", "max_steps=1", "--lora-rank", "8",
        "--lora-target-modules", "q_proj, v_proj", "--output-dir", str(tmp_path / "run"), "--dry-run",
    )
    assert code == 0
    lora_line = out.splitlines()[2]
    assert lora_line == "lora: {'r': 8, 'lora_alpha': 16, 'target_modules': ['q_proj', 'v_proj']}"


def test_lora_alpha_without_a_rank_is_a_clear_error(cli, tmp_path):
    code, _, err = cli("train", "--env", "counter", "--lora-alpha", "16", "--dry-run")
    assert code == 1
    assert "--lora-alpha needs --lora-rank" in err

def test_debug_flag_shows_the_traceback(cli_script):
    plain = cli_script("env", "show", "nope")
    debug = cli_script("--debug", "env", "show", "nope")
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert "Unknown environment 'nope'" in plain.stderr
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert "UnknownNameError" in debug.stderr


def test_docs_cli_md_is_current():
    from pathlib import Path

    from grpo_agent.cli.docs import cli_reference

    committed = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    assert committed == cli_reference() + "\n", (
        "docs/cli.md is out of date: run `python -m grpo_agent.cli.docs > docs/cli.md`."
    )


class CommandPlugin:
    __name__ = "commands"

    @staticmethod
    @hookimpl
    def register_commands(app):
        @app.command("hello")
        def hello(name: str = "world") -> None:
            """Say hello."""
            typer.echo(f"hello {name}")


def test_register_commands_hook_adds_a_command_to_the_app():
    from grpo_agent.plugins.manager import build_plugin_manager
    from typer.testing import CliRunner

    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """Root."""

    build_plugin_manager(load_entry_points=False, plugins=[CommandPlugin()]).hook.register_commands(app=app)
    result = CliRunner().invoke(app, ["hello", "--name", "plugins"])
    assert result.exit_code == 0 and result.output == "hello plugins\n"


class RaisingCommandPlugin:
    __name__ = "badcommands"

    @staticmethod
    @hookimpl
    def register_commands(app):
        raise RuntimeError("typo in my command set-up")


def test_a_raising_register_commands_hook_costs_only_its_own_commands(cli, monkeypatch):
    """It ended every command (`env list`, `plugins list`, `--help`) in its traceback."""
    from grpo_agent.cli import main as main_module
    from grpo_agent.plugins import manager

    pm = manager.build_plugin_manager(load_entry_points=False,
                                      plugins=[RaisingCommandPlugin(), CommandPlugin()])
    monkeypatch.setattr(manager, "plugin_manager", lambda **_: pm)
    app = typer.Typer()  # not the real app: the test's `hello` command must not outlive it

    @app.callback()
    def root() -> None:
        """Root."""

    monkeypatch.setattr(main_module, "app", app)
    main_module._add_optional_commands.cache_clear()
    try:
        code, out, err = cli("hello", "--name", "still")
    finally:
        main_module._add_optional_commands.cache_clear()
    assert code == 0 and out == "hello still\n", err
    assert err == ("Warning: plugin commands not loaded: Plugin 'badcommands' from test plugin "
                   "badcommands raised in its register_commands hook: RuntimeError: typo in my "
                   "command set-up. Fix it.\n")


def test_a_plugin_host_that_cannot_load_is_reported_once(cli, monkeypatch):
    """`GRPO_AGENT_LOAD_PLUGINS=countr grpo-agent env list` printed the same 500-character
    message twice, as a start-up warning and as the command's error."""
    from grpo_agent.cli import main as main_module
    from grpo_agent.plugins import manager

    app = typer.Typer()  # a fresh app: the doctor group is added to it again

    @app.callback()
    def root() -> None:
        """Root."""

    @app.command("needs-plugins")
    def needs_plugins() -> None:
        manager.load_registry()

    @app.command("no-plugins")
    def no_plugins() -> None:
        typer.echo("done")

    monkeypatch.setattr(main_module, "app", app)
    monkeypatch.setenv(manager.LOAD_ENV, "no-such-plugin-xyz")
    main_module._add_optional_commands.cache_clear()
    try:
        code, _, err = cli("needs-plugins")
        assert code == 1 and err.count("GRPO_AGENT_LOAD_PLUGINS names 'no-such-plugin-xyz'") == 1, err
        assert err.startswith("Error: GRPO_AGENT_LOAD_PLUGINS names"), err
        code, out, err = cli("no-plugins")  # still warned where the command itself cannot say it
        assert code == 0 and out == "done\n", err
        assert err.startswith("Warning: plugin commands not loaded: GRPO_AGENT_LOAD_PLUGINS names"), err
    finally:
        main_module._add_optional_commands.cache_clear()


def test_train_hands_the_parsed_config_to_run_training(cli, tmp_path, monkeypatch):
    import grpo_agent.train.run as run_module

    calls = []
    monkeypatch.setattr(run_module, "run_training", lambda **kw: calls.append(kw) or tmp_path)
    code, out, _ = cli(
        "train", "--env", "math", "--model", "/models/m", "--vllm-url", "http://127.0.0.1:9",
        "--output-dir", str(tmp_path), "--set", "num_generations=4",
    )
    assert code == 0 and out == f"Run finished: {tmp_path}\n"
    (call,) = calls
    assert call["env"] == "math" and call["model"] == "/models/m"
    assert call["vllm_url"] == "http://127.0.0.1:9"
    assert call["config"].num_generations == 4 and call["config"].output_dir == str(tmp_path)


@pytest.mark.parametrize(("rank", "expected"), [("0", "Run finished: {}\n"), ("1", "")])
def test_under_torchrun_only_rank_0_says_the_run_finished(cli, tmp_path, monkeypatch, rank,
                                                          expected):
    """Every rank returns from run_training after leaving the process group: RANK decides."""
    import grpo_agent.train.run as run_module

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(run_module, "run_training", lambda **kw: tmp_path)
    code, out, err = cli("train", "--env", "math", "--model", "/models/m", "--vllm-url",
                         "http://127.0.0.1:9", "--output-dir", str(tmp_path))
    assert code == 0 and out == expected.format(tmp_path), err


@pytest.mark.parametrize(("flags", "split", "advice"), [
    (["--env", "counter"], True, "grpo-agent eval --env counter --model {}/final"),
    (["--env", "reasoning-gym", "--env-arg", "size=200"], True,
     "grpo-agent eval --env reasoning-gym --env-arg size=200 --model {}/final"),
    (["--env", "words"], False, "the env declares no eval split")])
def test_train_ends_with_the_runs_summary(cli, tmp_path, monkeypatch, flags, split, advice):
    """A run without evaluation still says whether its training reward rose, and how to measure
    held-out success: by `grpo-agent eval` with the env options it was given, or not at all
    without a split."""
    import grpo_agent.train.run as run_module
    from grpo_agent.train.reporting import write_run_record

    def recording_run(**kw):  # run_training records the env and options it gets
        write_run_record(tmp_path, kw["env"], kw["env_args"], eval_split=split)
        return tmp_path

    rows = [{"step": 1, "loss": 0.1, "reward": 0.25}, {"step": 2, "loss": 0.1, "reward": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(run_module, "run_training", recording_run)
    code, out, err = cli("train", *flags, "--model", "/models/m", "--vllm-url",
                         "http://127.0.0.1:9", "--output-dir", str(tmp_path))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:2] == [f"Run finished: {tmp_path}", ("training reward (mean `reward` of the "
                         "logged windows): 0.250 over step 1 -> 0.500 over step 2 (+0.250)")]
    assert lines[2].startswith("held-out success: not measured") and advice.format(tmp_path) in lines[2]


def test_the_summary_of_a_lora_run_does_not_advise_evaluating_its_adapter_folder(tmp_path):
    """A `--lora-rank` run's final/ holds the adapter alone: the summary said to run
    `grpo-agent eval --model RUN/final`, which refuses an adapter-only folder; it says to merge."""
    from grpo_agent.train.eval_run import check_model_folder
    from grpo_agent.train.reporting import run_summary, write_run_record

    rows = [{"step": 1, "loss": 0.1, "reward": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_run_record(tmp_path, "counter", {}, eval_split=True)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="LoRA adapter only"):
        check_model_folder(str(tmp_path / "final"))  # what the old advice led to
    held_out = run_summary(tmp_path).splitlines()[1]
    assert f"--model {tmp_path / 'final'}" not in held_out
    assert (f"merge the LoRA adapter in {tmp_path / 'final'} into its base model" in held_out
            and "`grpo-agent eval --env counter --model MERGED`" in held_out)


def test_the_summarys_eval_advice_repeats_the_runs_env_options():
    from grpo_agent.train.reporting import env_flags

    assert env_flags("reasoning-gym", {"task": "leg_counting", "size": 200}) == (
        "--env reasoning-gym --env-arg task=leg_counting --env-arg size=200")
    assert env_flags("x", {"phrase": "two words"}) == "--env x --env-arg 'phrase=two words'"


def test_tiny_model_command_builds_the_model(cli, tmp_path):
    code, out, _ = cli("tiny-model", str(tmp_path / "tiny"))
    assert code == 0 and out.strip() == str(tmp_path / "tiny")
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert (tmp_path / "tiny" / "tokenizer.json").is_file()


@pytest.mark.parametrize("completion,expected", [(16, 1024), (2048, 2560), (8000, 4096)])
def test_the_managed_server_fits_the_runs_completions(tiny_model_path, completion, expected):
    # The spec's default max_completion_length (2048) must not fail `grpo-agent train --env X`
    # against the managed server; the tiny model's context (4096) caps it.
    from grpo_agent.sampler.server import managed_max_model_len

    assert managed_max_model_len(str(tiny_model_path), completion) == expected


def test_set_reads_true_and_false_in_any_case_as_booleans_and_other_text_as_text(cli):
    code, out, err = cli("config", "show", "--set", "gradient_checkpointing=False",
                         "--set", "log_completions=TRUE", "--set", "run_name=3x")
    config = json.loads(out)
    assert code == 0, err
    assert config["gradient_checkpointing"] is False and config["log_completions"] is True
    assert config["run_name"] == "3x"  # not JSON: kept as written


def test_set_without_a_key_is_one_line(cli):
    code, _, err = cli("config", "show", "--set", "=3")
    assert code == 1 and err.startswith("Error: --set '=3': write it as key=value"), err


def test_an_explicit_flag_beats_set_and_the_run_file_and_an_absent_one_changes_nothing(cli, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'output_dir = "{tmp_path / "from-file"}"\n')

    def output_dir(*args):
        code, out, err = cli("train", "--env", "counter", "--config", str(run_file), *args,
                             "--set", "max_steps=1", "--dry-run")
        assert code == 0, err
        return json.loads(out.split("\n", 2)[2])["output_dir"]

    assert output_dir() == str(tmp_path / "from-file")
    assert output_dir("--set", f"output_dir={tmp_path / 'from-set'}") == str(tmp_path / "from-set")
    assert output_dir("--set", f"output_dir={tmp_path / 'from-set'}",
                      "--output-dir", str(tmp_path / "from-flag")) == str(tmp_path / "from-flag")


def test_a_yml_run_file_is_read_and_an_empty_yaml_sets_nothing(cli, tmp_path):
    (tmp_path / "run.yml").write_text("max_staleness: 2\n")
    code, out, _ = cli("config", "show", "--config", str(tmp_path / "run.yml"))
    assert code == 0 and json.loads(out)["max_staleness"] == 2
    (tmp_path / "empty.yaml").write_text("# nothing set yet\n")
    code, out, err = cli("config", "show", "--config", str(tmp_path / "empty.yaml"))
    assert code == 0, err
    assert json.loads(out)["max_staleness"] == 4


@pytest.mark.parametrize(("name", "text", "message"), [
    # yaml's error was no CLI error: a traceback; tomllib's did not name the file.
    ("run.yaml", "max_steps: 3\n  learning_rate: [1\n",
     "is not valid YAML: mapping values are not allowed here (at line 2, column 16)."),
    ("run.toml", "max_steps = 3\nlearning_rate =\n", "is not valid TOML: Invalid value (at line 2"),
    ("folder", None, "is a folder: pass a .toml or .yaml run file."),
])
def test_a_run_file_that_cannot_be_read_is_one_line_naming_it(cli, tmp_path, name, text, message):
    path = tmp_path / name
    path.mkdir() if text is None else path.write_text(text)
    code, _, err = cli("config", "show", "--config", str(path))
    assert code == 1
    assert err.startswith(f"Error: Config file {path} {message}"), err
    assert err.count("\n") == 1


def test_plugin_arg_splits_at_the_last_dot_so_plugin_names_may_hold_dots():
    from grpo_agent.cli.config_files import parse_plugin_args

    assert parse_plugin_args(["my.plugin.cap=0.8", "curriculum.pass_rate_cap= 0.5"]) == {
        "my.plugin": {"cap": "0.8"}, "curriculum": {"pass_rate_cap": "0.5"}}


def test_the_env_flag_beats_the_run_files_env(cli, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('env = "counter"\n')
    code, out, err = cli("train", "--config", str(run_file), "--env", "math", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert code == 0, err
    assert out.startswith("env: math")


def test_run_file_env_args_must_be_a_table(cli, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('env = "counter"\nenv_args = "size=3"\n')
    code, _, err = cli("train", "--config", str(run_file), "--dry-run", "--output-dir", str(tmp_path))
    assert code == 1 and "env_args must be a table of option = value" in err


def test_plugin_arg_flags_add_to_the_run_files_options_of_that_plugin(cli, tmp_path, monkeypatch):
    """A flag overrides one option; the run file's other options of that plugin stay. (Only
    the shipped curriculum plugin has options, and just one: the option check is stubbed.)"""
    import grpo_agent.rollout.plugins as rollout_plugins

    monkeypatch.setattr(rollout_plugins, "check_plugin_args", lambda config, funcs: None)
    run_file = tmp_path / "run.toml"
    run_file.write_text('env = "counter"\nmax_steps = 1\n[plugin_args.curriculum]\npass_rate_cap = 0.5\n'
                        'window = 4\n')
    code, out, err = cli("train", "--config", str(run_file), "--plugin-arg", "curriculum.pass_rate_cap=0.7",
                         "--dry-run", "--output-dir", str(tmp_path))
    assert code == 0, err
    assert json.loads(out.split("\n", 2)[2])["plugin_args"] == {"curriculum": {"pass_rate_cap": "0.7", "window": 4}}


def test_lora_defaults_to_all_linear_as_one_name_and_an_explicit_alpha_is_kept(cli, tmp_path):
    """PEFT reads the string "all-linear" as every linear layer; a list ['all-linear'] would
    name a module that does not exist."""
    code, out, err = cli("train", "--env", "counter", "--set", "max_steps=1", "--lora-rank", "4",
                         "--lora-alpha", "5", "--output-dir", str(tmp_path), "--dry-run")
    assert code == 0, err
    assert out.splitlines()[2] == "lora: {'r': 4, 'lora_alpha': 5, 'target_modules': 'all-linear'}"
    code, _, err = cli("train", "--env", "counter", "--lora-rank", "4", "--lora-target-modules", " , ",
                       "--output-dir", str(tmp_path), "--dry-run")
    assert code == 1 and "--lora-target-modules is empty" in err


def test_env_check_of_a_broken_env_fails_with_exit_1_naming_the_failed_steps(cli, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    code, out, err = cli("env", "check", "test_check:StuckEnv", "--rows", "1")
    assert code == 1
    assert "FAIL tool pull({}) row 0: RuntimeError: the rope snapped" in out
    assert err.startswith("Error: env check test_check:StuckEnv: 2 step(s) failed: ")
    assert "gold answer row 0" in err


def test_eval_hands_its_flags_to_run_eval(cli, tmp_path, monkeypatch):
    from grpo_agent.train import eval_run

    calls = []
    monkeypatch.setattr(eval_run, "run_eval", lambda env, config, **kw: calls.append((env, config, kw)) or ({}, kw["out_path"]))
    monkeypatch.setattr(eval_run, "print_report", lambda report, path: print(f"report at {path}"))
    code, out, err = cli("eval", "--env", "math", "--model", "/models/m", "--num-generations", "3",
                         "--temperature", "0.7", "--set", "max_completion_length=64",
                         "--env-arg", "k=v", "--out", str(tmp_path / "r.json"))
    assert code == 0, err
    assert out == f"report at {tmp_path / 'r.json'}\n"
    ((env, config, kw),) = calls
    assert env == "math" and kw["model"] == "/models/m" and kw["env_args"] == {"k": "v"}
    assert (config.eval_num_generations, config.eval_temperature, config.max_completion_length) == (3, 0.7, 64)


def test_eval_set_reaches_the_eval_fields_its_flags_were_not_given_for(cli, tmp_path, monkeypatch):
    """`eval --set eval_num_generations=4 --set eval_temperature=0.7` evaluated greedily with one
    rollout per row: the flags' defaults (1 and 0.0) overwrote the --set values silently."""
    from grpo_agent.train import eval_run

    calls = []
    monkeypatch.setattr(eval_run, "run_eval", lambda env, config, **kw: calls.append(config) or ({}, kw["out_path"]))
    monkeypatch.setattr(eval_run, "print_report", lambda report, path: None)
    sets = ["--set", "eval_num_generations=4", "--set", "eval_temperature=0.7"]
    assert cli("eval", "--env", "math", *sets)[0] == 0
    assert cli("eval", "--env", "math", "--num-generations", "2", "--temperature", "0", *sets)[0] == 0
    assert cli("eval", "--env", "math")[0] == 0
    assert [(c.eval_num_generations, c.eval_temperature) for c in calls] == [(4, 0.7), (2, 0.0), (1, 0.0)]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--temperature", "3"], ("--temperature=3.0 is out of range: set --temperature <= 2 (vLLM "
                              "refuses every request above it).")),
    (["--temperature", "-1"], "--temperature=-1.0 is out of range: set --temperature >= 0 (0 = greedy)."),
    (["--set", "eval_temperature=3"], ("eval_temperature=3 is out of range: set eval_temperature "
                                       "<= 2 (vLLM refuses every request above it).")),
])
def test_eval_refuses_a_temperature_vllm_refuses_before_a_server_starts(cli, monkeypatch, flags,
                                                                        expected):
    """`eval --temperature 3` started a server and then failed every request with vLLM's
    "temperature must be in [0, 2]". Both bounds speak with the config's one rule, naming what
    the user wrote: the flag, or the field for --set (the flag's refusal named the field)."""
    from grpo_agent.train import eval_run

    monkeypatch.setattr(eval_run, "run_eval", lambda *a, **kw: pytest.fail("a server was started"))
    code, out, err = cli("eval", "--env", "math", *flags)
    assert code == 1 and out == ""
    assert err.startswith(f"Error: {expected}"), err


def test_eval_of_a_runs_model_uses_the_runs_rollout_settings(cli, tmp_path, monkeypatch):
    """`grpo-agent eval --model runs/demo/final` rendered the counter demo's prompts with the
    default chat template (thinking on) instead of the run's enable_thinking=false: pass@1 0.00
    where the run's own evaluation of the same weights said 0.44."""
    from grpo_agent.config import AsyncGRPOConfig
    from grpo_agent.train import eval_run

    run = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                          chat_template_kwargs={"enable_thinking": False},
                          max_completion_length=32, max_tool_calling_iterations=2, learning_rate=0.5)
    (tmp_path / "config.json").write_text(run.to_json_string())
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text('{"model_type": "qwen3"}')  # a model's own
    calls = []
    monkeypatch.setattr(eval_run, "run_eval", lambda env, config, **kw: calls.append(config) or ({}, kw["out_path"]))
    monkeypatch.setattr(eval_run, "print_report", lambda report, path: None)
    code, out, err = cli("eval", "--env", "counter", "--model", str(tmp_path / "final"),
                         "--set", "max_completion_length=64")
    assert code == 0, err
    (config,) = calls
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert (config.max_tool_calling_iterations, config.max_completion_length) == (2, 64)  # --set wins
    assert config.learning_rate != 0.5  # only the fields that shape rollouts come from the run
    assert out == (f"Rollout settings from the run that saved this model ({tmp_path / 'config.json'}), "
                   "as its own evaluations used them: chat_template_kwargs={'enable_thinking': False}, "
                   "max_completion_length=32, max_tool_calling_iterations=2; --set overrides any.\n")
    # A model folder that is not a run's output (its parent holds no run config) changes nothing.
    assert cli("eval", "--env", "counter", "--model", str(tmp_path))[1] == ""
    assert calls[-1].chat_template_kwargs is None


def test_an_eval_that_fails_is_one_line_naming_the_error(cli, monkeypatch):
    """`eval --vllm-url http://127.0.0.1:9` (nothing listening) printed a 70-line traceback before
    the sampler's own one-line explanation."""
    from grpo_agent.sampler.errors import ServerUnreachableError
    from grpo_agent.train import eval_run

    def unreachable(*args, **kwargs):
        raise ServerUnreachableError("No vLLM server answered at http://127.0.0.1:9. Start one.")

    monkeypatch.setattr(eval_run, "run_eval", unreachable)
    code, out, err = cli("eval", "--env", "math", "--vllm-url", "http://127.0.0.1:9")
    assert code == 1 and out == ""
    assert err == ("Error: The evaluation failed: ServerUnreachableError: No vLLM server answered at "
                   "http://127.0.0.1:9. Start one. (run with --debug for the traceback)\n"), err


def test_env_check_refuses_fewer_than_one_row(cli):
    # Before, --rows 0 reset nothing, called no tool, scored no gold and still said "all 3 steps passed".
    code, out, err = cli("env", "check", "counter", "--rows", "0")
    assert code == 2
    assert "Invalid value for '--rows'" in err
    assert "passed" not in out


def test_dict_fields_take_json_objects_and_path_fields_keep_their_paths(cli, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text("chat_template_kwargs = '{\"enable_thinking\": false}'\n")
    code, out, err = cli("config", "show", "--config", str(run_file), "--set", "fsdp_config=fsdp.json",
                         "--set", 'lr_scheduler_kwargs={"num_decay_steps": 10}')
    assert code == 0, err
    config = json.loads(out)
    assert config["fsdp_config"] == "fsdp.json"  # a path to a JSON file, as in transformers
    assert config["lr_scheduler_kwargs"] == {"num_decay_steps": 10}
    assert config["chat_template_kwargs"] in ({"enable_thinking": False}, '{"enable_thinking": false}')


def test_set_values_of_the_fields_type_are_kept(cli):
    code, out, err = cli("config", "show", "--set", "max_steps=3", "--set", "learning_rate=1",
                         "--set", "token_budget=null", "--set", "gradient_checkpointing=false")
    assert code == 0, err
    config = json.loads(out)
    assert (config["max_steps"], config["learning_rate"]) == (3, 1)
    assert (config["token_budget"], config["gradient_checkpointing"]) == (None, False)


def test_set_keeps_the_text_of_a_text_field_and_a_run_files_number_there_is_one_line(cli, tmp_path):
    # `--set output_dir=3` reached the config as the number 3 and failed as "expected str,
    # bytes or os.PathLike object, not int", naming no field.
    code, out, err = cli("config", "show", "--set", "output_dir=3", "--set", "run_name=2024",
                         "--set", "resume_from_checkpoint=true", "--set", "max_steps=3")
    assert code == 0, err
    config = json.loads(out)
    assert (config["output_dir"], config["run_name"], config["max_steps"]) == ("3", "2024", 3)
    assert config["resume_from_checkpoint"] == "true"  # read as "the newest checkpoint"
    run_file = tmp_path / "run.toml"
    run_file.write_text("output_dir = 3\n")
    code, _, err = cli("config", "show", "--config", str(run_file))
    assert code == 1
    assert err.startswith("Error: Config field 'output_dir' takes text, got 3. Quote it in the run "
                          "file (output_dir = \"3\")."), err
