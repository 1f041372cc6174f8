"""Entry point of the `grpo_agent` group: registers the coding environment with the host."""
from grpo_agent import Option, environment, hookimpl

from grpo_agent_env_coding.env import CodingEnv
from grpo_agent_env_coding.suites import SUITES, load_suite


def solve(env: CodingEnv, row: dict) -> None:
    """Gold run for `grpo-agent env check`: run the reference solution (reward then 1.0)."""
    env.run_code(env.task["solution"])


def task_rows(suite: str):
    """One row per task of the suite, so an epoch visits every task once."""
    from datasets import Dataset

    return Dataset.from_dict({"task_id": [task["task_id"] for task in load_suite(suite)]})


@hookimpl
def register_environments(register):
    register(
        environment(
            "coding", version=1, tool_examples={"run_code": {"code": "print(6 * 7)"}}, gold=solve,
            dataset=task_rows,
            options=[Option("suite", str, "small", "task suite: small (8 tasks) or humaneval (164)",
                            choices=SUITES)],
            description="Write Python functions (small suite or HumanEval); graded by unit tests in a sandbox.",
        )(CodingEnv)
    )
