"""The reasoning-gym env, installed from the registry and found through its entry point."""
from __future__ import annotations

import pytest
from grpo_agent.plugins import OptionError, load_registry
from grpo_agent.plugins.check import NoGoldAnswer
from grpo_agent_env_reasoning_gym import tasks

# reasoning-gym 0.1.25's scorer for this task compares bool(answer) with bool(truth), so any
# non-empty text scores 1.0 when the truth is True: no wrong answer exists to test with.
TOLERANT_SCORERS = {"game_of_life_halting"}


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.fixture
def cli(capsys):
    """`cli(*args) -> (exit_code, stdout, stderr)` of the `grpo-agent` CLI, in this process."""
    from grpo_agent.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as done:
            main(list(args))
        captured = capsys.readouterr()
        return done.value.code or 0, captured.out, captured.err

    return run


def answer(text: str) -> list[list[dict]]:
    return [[{"role": "assistant", "content": f"Let me think.\n<answer>{text}</answer>"}]]


def score(registry, row: dict, completion: list[list[dict]]) -> float:
    fn = registry.resolve_reward("reasoning_gym")
    columns = {key: [row[key]] for key in ("task", "size", "seed", "index")}
    return fn(prompts=[row["prompt"]], completions=completion, completion_ids=[[]], **columns)[0]


def test_the_installed_package_registers_the_env_and_its_reward(registry):
    assert registry.distribution_of("environment", "reasoning-gym") == "grpo-agent-env-reasoning-gym"
    spec = registry.environment_spec("reasoning-gym")
    assert spec.rewards == ["reasoning_gym"] and spec.option_values["task"] == "leg_counting"


def test_the_task_option_lists_every_reasoning_gym_task(registry):
    from reasoning_gym.factory import DATASETS

    choices = registry.environment_spec("reasoning-gym").options[0].allowed()
    assert set(choices) == set(DATASETS) - {"composite"} and len(choices) > 100
    with pytest.raises(OptionError, match=r"has no choice 'countdwn' \(did you mean: countdown"):
        registry.environment_spec("reasoning-gym", {"task": "countdwn"})


def test_every_task_scores_its_reference_answer_1_and_a_wrong_one_lower(registry):
    no_reference = []
    for task in tasks.task_names():
        spec = registry.environment_spec("reasoning-gym", {"task": task, "size": 2})
        row = dict(spec.load_dataset()[1])
        env = spec()
        question = env.reset(**row)
        assert question == tasks.entry(task, 2, 42, 1)["question"] and question, task
        try:
            gold = spec.gold(env, row)
        except NoGoldAnswer:
            no_reference.append(task)
        else:
            assert score(registry, row, [[{"role": "assistant", "content": gold}]]) == 1.0, task
        if task not in TOLERANT_SCORERS:
            assert score(registry, row, answer("no idea, sorry")) < 1.0, task
    # tasks whose answers are many (a colouring, a sequence of moves) ship no reference
    assert set(no_reference) == {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}


def test_countdown_reward_is_the_tasks_own_score(registry):
    spec = registry.environment_spec("reasoning-gym", {"task": "countdown", "size": "3", "seed": "7"})
    row = dict(spec.load_dataset()[0])
    item = tasks.entry("countdown", 3, 7, 0)
    target, numbers = item["metadata"]["target"], item["metadata"]["numbers"]
    assert score(registry, row, answer(item["answer"])) == 1.0
    wrong = "+".join(map(str, numbers))  # uses every number once, but misses the target
    assert sum(numbers) != target and score(registry, row, answer(wrong)) < 1.0
    no_tags = [[{"role": "assistant", "content": item["answer"]}]]
    assert score(registry, row, no_tags) == 0.0  # reasoning-gym reads only <answer> tags


def test_train_and_eval_splits_come_from_different_seeds(registry):
    spec = registry.environment_spec("reasoning-gym", {"task": "basic_arithmetic", "size": 30, "eval_size": 10})
    train, evaluation = spec.load_dataset(), spec.load_eval_dataset()
    assert (len(train), len(evaluation)) == (30, 10)
    assert set(train["seed"]) == {42} and set(evaluation["seed"]) == {42 + tasks.EVAL_SEED_OFFSET}
    questions = {tasks.entry(r["task"], r["size"], r["seed"], r["index"])["question"] for r in train}
    held_out = {tasks.entry(r["task"], r["size"], r["seed"], r["index"])["question"] for r in evaluation}
    assert len(questions) == 30 and not questions & held_out
    again = registry.environment_spec("reasoning-gym", {"task": "basic_arithmetic", "size": 30})
    assert again.load_dataset()["prompt"] == train["prompt"]  # same seed, same rows
    assert train[0]["prompt"][0]["role"] == "system" and "<answer>" in train[0]["prompt"][0]["content"]


def test_an_empty_split_is_refused_naming_the_option(registry):
    spec = registry.environment_spec("reasoning-gym", {"task": "basic_arithmetic", "size": 0, "eval_size": 0})
    with pytest.raises(ValueError, match="reasoning-gym split size must be at least 1, got 0"):
        spec.load_dataset()
    with pytest.raises(ValueError, match="reasoning-gym split size must be at least 1, got 0"):
        spec.load_eval_dataset()


def test_env_check_passes_through_the_cli(cli):
    code, out, err = cli("env", "check", "reasoning-gym", "--env-arg", "task=countdown")
    assert code == 0, out + err
    assert "gold answer row 0: reward 1.0" in out and "FAIL" not in out


def test_env_show_lists_the_options_and_tasks(cli):
    code, out, _ = cli("env", "show", "reasoning-gym", "--env-arg", "task=countdown", "--env-arg", "size=5")
    assert code == 0
    assert "task (str, default 'leg_counting'): reasoning-gym task  [now 'countdown']" in out
    assert "countdown, course_schedule" in out
    assert "dataset: 5 rows, columns: prompt, task, size, seed, index" in out


def test_the_python_form_is_a_picklable_factory_with_its_data_and_rewards():
    import pickle

    from grpo_agent import load_environment
    from grpo_agent.plugins import check_picklable

    env = load_environment("reasoning-gym", task="countdown", size=3)
    check_picklable({"environment_factory": env})  # what the trainer checks before spawning
    row = dict(env.load_dataset()[2])
    assert pickle.loads(pickle.dumps(env))().reset(**row) == tasks.entry("countdown", 3, 42, 2)["question"]
    assert [fn.__name__ for fn in env.reward_funcs()] == ["reasoning_gym_reward"]


def test_env_list_shows_the_installed_package(cli):
    code, out, _ = cli("env", "list")
    assert code == 0
    assert "reasoning-gym-v1 (alias reasoning-gym)  [grpo-agent-env-reasoning-gym]" in out


def test_run_file_env_args_merge_under_command_line_ones(cli, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('env = "reasoning-gym"\nmax_steps = 2\n[env_args]\ntask = "countdown"\nsize = 50\n')
    code, out, err = cli("train", "--config", str(run_file), "--env-arg", "size=5", "--dry-run",
                         "--output-dir", str(tmp_path))
    assert code == 0, err
    assert out.splitlines()[0] == (
        "env: reasoning-gym-v1 [grpo-agent-env-reasoning-gym]  options: "
        "{'task': 'countdown', 'size': 5, 'eval_size': 100, 'seed': 42}"
    )
