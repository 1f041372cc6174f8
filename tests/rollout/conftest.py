"""Rollout tests: helpers importable by the spawned worker, and the session's vLLM server."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The spawned rollout worker unpickles helper rewards/loops by module name; children inherit
# sys.path, so this makes `rollout_test_helpers` importable there too.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def rollout_server(vllm_server):
    """`(base_url, model_path)` of the session's real vLLM server on the tiny model."""
    return vllm_server.base_url, str(vllm_server.model_path)


@pytest.fixture(scope="session")
def rollout_tokenizer(rollout_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(rollout_server[1])
