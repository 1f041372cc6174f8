"""Every reasoning-gym task as a grpo-agent env: `--env reasoning-gym --env-arg task=countdown`.

The task's procedural generator is the dataset (train split from `seed`, eval split from
`seed + EVAL_SEED_OFFSET`) and the task's own scorer is the reward (`reasoning_gym`), applied to
the completion's last `<answer>...</answer>`. Design decision: one env with a `task` option
rather than a hundred registered names, so `env list` stays readable and `env show
reasoning-gym` lists the tasks.
"""
from __future__ import annotations

from grpo_agent import Option, environment, hookimpl, reward
from grpo_agent.rewards import completion_text

from grpo_agent_env_reasoning_gym import tasks

OPTIONS = [
    Option("task", str, "leg_counting", "reasoning-gym task", choices=tasks.task_names),
    Option("size", int, 1000, "rows in the train split"),
    Option("eval_size", int, 100, "rows in the eval split"),
    Option("seed", int, 42, "generator seed of the train split (eval: seed + 1000003)"),
]


def _dataset(task: str, size: int, seed: int):
    from datasets import Dataset

    if size < 1:
        raise ValueError(f"reasoning-gym split size must be at least 1, got {size}.")
    return Dataset.from_dict(tasks.rows(task, size, seed))


def train_split(task: str, size: int, eval_size: int, seed: int):
    """The train split: `size` entries generated from `seed`."""
    return _dataset(task, size, seed)


def eval_split(task: str, size: int, eval_size: int, seed: int):
    """The eval split: `eval_size` entries from a seed the train split never uses."""
    return _dataset(task, eval_size, seed + tasks.EVAL_SEED_OFFSET)


@reward("reasoning_gym")
def reasoning_gym_reward(completions, task, size, seed, index, **kwargs) -> list[float]:
    """The task's own score of each completion's last <answer>...</answer> (0 without one)."""
    return [
        tasks.score(tasks.extract(completion_text(c)), t, n, s, i)
        for c, t, n, s, i in zip(completions, task, size, seed, index, strict=True)
    ]


def gold_answer(env: ReasoningGymEnv, row: dict) -> str:
    """The generator's reference answer in answer tags, for `grpo-agent env check`."""
    from grpo_agent.plugins.check import NoGoldAnswer

    answer = tasks.entry(row["task"], row["size"], row["seed"], row["index"])["answer"]
    if answer is None:
        raise NoGoldAnswer(f"task {row['task']!r} has many valid answers and ships no reference")
    return f"<answer>{answer}</answer>"


@environment(
    "reasoning-gym",
    version=1,
    dataset=train_split,
    eval_dataset=eval_split,
    rewards=["reasoning_gym"],
    gold=gold_answer,
    options=OPTIONS,
    description="Every reasoning-gym task (--env-arg task=NAME), scored by the task's own scorer.",
)
class ReasoningGymEnv:
    """One generated question per rollout; no tools, one answer scored by reasoning-gym."""

    def __init__(self, task: str, size: int, eval_size: int, seed: int):
        self.task = task  # the rows carry the task too, so train and eval rows reset alike

    def reset(self, task: str, size: int, seed: int, index: int, **row) -> str:
        """The row's question, generated now (it follows the row's system instruction)."""
        return tasks.entry(task, size, seed, index)["question"]


@hookimpl
def register_environments(register):
    register(ReasoningGymEnv)


@hookimpl
def register_rewards(register):
    register(reasoning_gym_reward)
