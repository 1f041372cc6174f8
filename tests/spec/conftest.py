"""Fixtures for the spec's examples: the servers they train against (helpers: spec_harness.py).

The session's vLLM server (tiny model) serves the examples without tools; the agent examples
need a model that emits tool calls, so their module starts one server on the tool-warmed tiny
model. Every trainer pushes weights, so a server this session did not start is never used.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The spawned rollout worker unpickles the examples' rewards, tools, environments and loops by
# module name; children inherit sys.path, so `spec_examples` is importable there too.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def spec_server(trained_server):
    """The session's server on the tiny model (restored after each module: conftest.py)."""
    return trained_server
