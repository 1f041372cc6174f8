"""Coding environment for grpo-agent: write a function, run it in a sandbox, pass the tests."""
from grpo_agent_env_coding.env import CodingEnv, load_tasks

__all__ = ["CodingEnv", "load_tasks"]
