"""Real entry-point discovery: pip-install a throwaway plugin distribution, see it, remove it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

DIST = "grpo-agent-throwaway-test"

PYPROJECT = f"""
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{DIST}"
version = "0.0.1"

[project.entry-points.grpo_agent]
throwaway = "grpo_agent_throwaway_test"

[tool.setuptools]
py-modules = ["grpo_agent_throwaway_test"]
"""

MODULE = '''
"""A throwaway plugin: one env with a gold answer, one reward."""
from grpo_agent import environment, hookimpl, reward


@reward("throwaway_len")
def length(completions, **kwargs):
    return [float(len(c[-1]["content"])) for c in completions]


def solve(env, row):
    return "hello"


@environment("throwaway", version=1, rewards=["throwaway_len"], gold=solve,
             tool_examples={"shout": {"text": "hi"}})
class ThrowawayEnv:
    """Say hello."""

    def reset(self, **row):
        return "Say hello."

    def shout(self, text: str) -> str:
        """Shout the text.

        Args:
            text: What to shout.
        """
        return text.upper()


@hookimpl
def register_environments(register):
    register(ThrowawayEnv)


@hookimpl
def register_rewards(register):
    register(length)
'''


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False,
                          timeout=300)


@pytest.mark.slow
def test_installed_plugin_is_listed_checked_and_gone_after_uninstall(tmp_path, cli_script):
    source = tmp_path / DIST
    source.mkdir()
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (source / "grpo_agent_throwaway_test.py").write_text(MODULE)
    installed = _pip("install", "--no-deps", "--no-build-isolation", "-q", str(source))
    assert installed.returncode == 0, installed.stderr
    try:
        listing = cli_script("plugins", "list")
        assert listing.returncode == 0, listing.stderr
        assert f"{DIST} 0.0.1  (plugin throwaway)" in listing.stdout
        assert "environment: throwaway-v1" in listing.stdout
        assert "reward: throwaway_len" in listing.stdout
        envs = cli_script("env", "list")
        assert f"throwaway-v1 (alias throwaway)  [{DIST}]  Say hello." in envs.stdout
        check = cli_script("env", "check", "throwaway", env={"GRPO_AGENT_LOAD_PLUGINS": "throwaway"})
        assert check.returncode == 0, check.stdout + check.stderr
        assert "tool shout({'text': 'hi'}) row 0: returned 'HI'" in check.stdout
        assert "gold answer row 0: reward 5.0" in check.stdout
    finally:
        removed = _pip("uninstall", "-y", DIST)
    assert removed.returncode == 0, removed.stderr
    after = cli_script("plugins", "list")
    assert after.returncode == 0 and DIST not in after.stdout
    assert "throwaway" not in cli_script("env", "list").stdout
