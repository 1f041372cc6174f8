"""Exceptions the CLI reports as one line (exit code 1) instead of a traceback."""
from __future__ import annotations

from grpo_agent.plugins.errors import PluginError

# Set by `--debug` (a flag of the main callback) and read by the commands that catch errors.
DEBUG_ENV = "GRPO_AGENT_DEBUG"


class CliError(Exception):
    """A user mistake detected by a command (bad flag value, missing file)."""


# ValueError/TypeError: config validation and the pickling rule raise sentences meant for users.
CLI_ERRORS: tuple[type[BaseException], ...] = (
    CliError,
    PluginError,
    ValueError,
    TypeError,
    FileNotFoundError,
)
