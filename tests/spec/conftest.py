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


@pytest.fixture(scope="module")
def warm_server(tmp_path_factory):
    """A server on the tool-warmed tiny model, for one module's agent examples."""
    from grpo_agent.sampler.server import ManagedVLLMServer
    from grpo_agent.testing.warmup import build_tool_warmed_model

    server = ManagedVLLMServer(
        build_tool_warmed_model(), dtype="float32", max_model_len=1024, enforce_eager=True,
        log_path=tmp_path_factory.mktemp("vllm-spec-agent") / "server.log",
    )
    with server:
        yield server
