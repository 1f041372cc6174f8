"""Entry point of the `grpo_agent` group: registers the coding environment with the host."""
from grpo_agent.plugins import environment, hookimpl

from grpo_agent_env_coding.env import CodingEnv


@hookimpl
def register_environments(register):
    register(environment("coding")(CodingEnv))
