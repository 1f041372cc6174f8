"""Entry point of the `grpo_agent` group: registers the coding environment with the host."""
from grpo_agent.plugins.decorators import environment
from grpo_agent.plugins.hookspecs import hookimpl

from grpo_agent_env_coding.env import CodingEnv


def solve(env: CodingEnv, row: dict) -> None:
    """Gold run for `grpo-agent env check`: run the reference solution (reward then 1.0)."""
    env.run_code(env.task["solution"])


@hookimpl
def register_environments(register):
    register(
        environment(
            "coding", version=1, tool_examples={"run_code": {"code": "print(6 * 7)"}}, gold=solve,
            description="Write small Python functions; graded by unit tests in a sandbox.",
        )(CodingEnv)
    )
