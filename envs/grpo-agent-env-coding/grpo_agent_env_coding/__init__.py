"""Coding environment for grpo-agent: write a function, run it in a sandbox, pass the tests.

This module is the package's `grpo_agent` entry point: it registers the decorated env class.
"""
from grpo_agent import hookimpl

from grpo_agent_env_coding.env import CodingEnv, load_tasks

__all__ = ["CodingEnv", "load_tasks"]


@hookimpl
def register_environments(register):
    register(CodingEnv)
