"""Rollout tests: the session's vLLM server (or, before the shared fixture exists, our own)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The spawned rollout worker unpickles helper rewards/loops by module name; children inherit
# sys.path, so this makes `rollout_test_helpers` importable there too.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def rollout_server(request):
    """`(base_url, model_path)` of a real vLLM server on the tiny model."""
    try:
        server = request.getfixturevalue("vllm_server")
    except pytest.FixtureLookupError:
        from grpo_agent.sampler.server import ManagedVLLMServer
        from grpo_agent.testing import build_tiny_model

        server = ManagedVLLMServer(build_tiny_model(), max_model_len=512).start()
        request.addfinalizer(server.stop)
    return server.base_url, str(server.model_path)


@pytest.fixture(scope="session")
def rollout_tokenizer(rollout_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(rollout_server[1])
