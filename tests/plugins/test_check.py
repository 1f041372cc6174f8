"""`check_environment` reports each failing step instead of stopping at the first."""
from __future__ import annotations

from grpo_agent import Option, environment, hookimpl, reward
from grpo_agent.plugins import build_registry
from grpo_agent.plugins.check import NoGoldAnswer, check_environment
from grpo_agent.plugins.registry import environment_spec_from_class


def wrong_gold(env, row):
    env.push(1)


@environment("stuck", tool_examples={"push": {"amount": 2}, "pull": {}}, gold=wrong_gold)
class StuckEnv:
    """An env whose gold answer does not solve it and whose pull tool crashes."""

    def reset(self, **row):
        self.total = 0
        return "Reach 5."

    def get_reward(self) -> float:
        return float(self.total == 5)

    def push(self, amount: int) -> int:
        """Push.

        Args:
            amount: How much to push.
        """
        self.total += amount
        return self.total

    def pull(self) -> int:
        """Pull (broken)."""
        raise RuntimeError("the rope snapped")


class StuckPlugin:
    __name__ = "stuck"

    @hookimpl
    def register_environments(self, register):
        register(StuckEnv)


def test_failing_steps_are_reported_with_their_errors():
    registry = build_registry(StuckPlugin())
    steps = {step.name: step for step in check_environment(registry.environment_spec("stuck"), registry, 1)}
    assert steps["reset row 0"].ok and steps["reset row 0"].detail == "'Reach 5.'"
    assert steps["tool push({'amount': 2}) row 0"].detail == "returned 2"
    assert not steps["tool pull({}) row 0"].ok
    assert steps["tool pull({}) row 0"].detail == "RuntimeError: the rope snapped"
    gold = steps["gold answer row 0"]
    assert not gold.ok and gold.detail == "ValueError: the gold answer scored 0.0; expected a positive reward."


def test_a_reset_without_prompt_and_no_prompt_column_fails():
    class Silent:
        def reset(self, **row):
            return None

    registry = build_registry()
    steps = check_environment(environment_spec_from_class(Silent, "silent", "test"), registry, 1)
    (reset,) = [step for step in steps if step.name == "reset row 0"]
    assert not reset.ok and "returned None and the row has no 'prompt' column" in reset.detail


SEEN: dict = {}


def answered(prompts, completions, completion_ids, **columns):
    SEEN.update(columns, prompts=prompts)
    return [1.0]


async def awaited(completions, **kwargs):
    return [0.5]


def unscored(completions, **kwargs):
    return [None]


def gold_text(env, row):
    return "the answer"


@environment("scored", rewards=["answered", "awaited", "unscored"], gold=gold_text,
             dataset=lambda: [{"prompt": "Q?", "level": 3}])
class ScoredEnv:
    """An env scored by three rewards and its own async get_reward."""

    def reset(self, **row):
        return None

    async def get_reward(self) -> float:
        return 0.25


class ScoredPlugin:
    __name__ = "scored"

    @hookimpl
    def register_rewards(self, register):
        register(answered)
        register(awaited)
        register(unscored)

    @hookimpl
    def register_environments(self, register):
        register(ScoredEnv)


def test_a_gold_answer_scores_every_reward_plus_get_reward_as_a_run_sums_them():
    """Async rewards and get_reward are awaited, None counts 0, and rewards see the row's
    columns except `prompt` (it comes as `prompts`), as in a training run's scoring."""
    from grpo_agent.plugins.check import score_gold

    registry = build_registry(ScoredPlugin())
    SEEN.clear()
    assert score_gold(registry.environment_spec("scored"), registry, {"prompt": "Q?", "level": 3}) == 1.75
    assert SEEN == {"level": [3], "prompts": ["Q?"]}


def no_reference(env, row):
    raise NoGoldAnswer("many answers are right")


def crashing_gold(env, row):
    raise ValueError("the solver broke")


@environment("open", gold=no_reference, dataset=lambda: [{"prompt": "Name a prime."}])
class OpenQuestionEnv:
    def reset(self, **row):
        return None


def test_a_row_without_a_reference_answer_is_skipped_and_a_crashing_gold_fails():
    registry = build_registry()
    spec = environment_spec_from_class(OpenQuestionEnv, None, "test")
    (gold,) = [step for step in check_environment(spec, registry, 1) if step.name == "gold answer row 0"]
    assert gold.ok and gold.detail == "skipped: many answers are right"
    spec.gold = crashing_gold
    (gold,) = [step for step in check_environment(spec, registry, 1) if step.name == "gold answer row 0"]
    assert not gold.ok and gold.detail == "ValueError: the solver broke"


def test_a_short_dataset_checks_the_rows_it_has_and_no_gold_means_no_gold_step():
    class Plain:
        def reset(self, **row):
            return "go"

        def get_reward(self) -> float:
            return 0.0

    spec = environment_spec_from_class(Plain, "plain", "test")
    spec.dataset = lambda: [{"prompt": "only row"}]
    steps = check_environment(spec, build_registry(), 3)
    assert [(step.name, step.ok) for step in steps] == [
        ("dataset", True), ("tool schemas", True), ("rewards", True), ("reset row 0", True)]


def test_an_agent_only_env_is_checked_without_a_reset():
    class Played:
        agent_only = "player"

        def reset(self, **row):
            raise RuntimeError("played by its agent")

    spec = environment_spec_from_class(Played, "played", "test")
    steps = check_environment(spec, build_registry(), 2)
    assert all(step.ok for step in steps), steps
    assert [step.name for step in steps] == ["dataset", "tool schemas", "rewards", "episodes"]
    assert steps[2].detail == "the 'player' agent's own score"
    assert "--agent player" in steps[-1].detail


@environment("taskset-played", options=[Option("id", str, "", "taskset id (required)"),
                                          Option("size", int, 100, "tasks taken")])
class PlayedTaskset:
    agent_only = "player"

    def __init__(self, id: str = "", size: int = 100):
        self.id = id

    def reset(self, **row):
        raise RuntimeError("played by its agent")


def test_an_agent_only_envs_suggested_run_keeps_the_env_args_it_was_checked_with():
    """`grpo-agent env check verifiers --env-arg id=TASKSET` suggested a run without `--env-arg
    id=...`, which fails at once ("verifiers needs a taskset: --env-arg id=TASKSET")."""
    spec = environment_spec_from_class(PlayedTaskset, None, "test").bind({"id": "my words", "size": "100"})
    steps = check_environment(spec, build_registry(), 2)
    assert ("grpo-agent train --env taskset-played --env-arg 'id=my words' --agent player "
            "--set max_steps=1") in steps[-1].detail, steps[-1].detail
    assert "size=" not in steps[-1].detail  # a default needs no flag


@reward("says_hi", options=[Option("bonus", float, 2.0, "reward when the answer says hi")])
def says_hi(prompts, completions, completion_ids, *, bonus: float, **columns):
    return [bonus if "hi" in completion[-1]["content"] else 0.0 for completion in completions]


@environment("greet", dataset=lambda: [{"prompt": "Greet me."}], rewards=["says_hi"],
             gold=lambda env, row: "hi")
class GreetEnv:
    def reset(self, **row):
        return None


class GreetPlugin:
    __name__ = "greet"

    @hookimpl
    def register_rewards(self, register):
        register(says_hi)

    @hookimpl
    def register_environments(self, register):
        register(GreetEnv)


def test_a_gold_answer_is_scored_by_rewards_with_their_declared_options():
    # Before: the reward was called without its options, so the gold step failed with
    # "TypeError: says_hi() missing 1 required keyword-only argument: 'bonus'".
    registry = build_registry(GreetPlugin())
    (gold,) = [step for step in check_environment(registry.environment_spec("greet"), registry, 1)
               if step.name == "gold answer row 0"]
    assert gold.ok, gold.detail
    assert gold.detail == "reward 2.0"


def test_an_env_without_any_reward_source_fails_its_rewards_step():
    """It passed as "rewards: get_reward only" though the env had no get_reward; `train --env`
    then dropped every group as unscored."""
    class Unscored:
        def reset(self, **row):
            return "go"

    class SelfScored(Unscored):
        def get_reward(self) -> float:
            return 1.0

    registry = build_registry()
    (rewards,) = [step for step in check_environment(environment_spec_from_class(
        Unscored, "unscored", "test"), registry, 1) if step.name == "rewards"]
    assert not rewards.ok and rewards.detail.startswith(
        "ValueError: no reward source: declare rewards=[...] in @environment(...) or define "
        "get_reward()"), rewards.detail
    (rewards,) = [step for step in check_environment(environment_spec_from_class(
        SelfScored, "scored", "test"), registry, 1) if step.name == "rewards"]
    assert rewards.ok and rewards.detail == "get_reward only"
