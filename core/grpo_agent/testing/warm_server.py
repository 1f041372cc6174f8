"""A vLLM server on the tool-warmed tiny model for tests that push weights into it."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

WARM_URL_ENV = "GRPO_AGENT_TEST_WARM_VLLM_URL"


@contextlib.contextmanager
def tool_warmed_server(log_dir: Path) -> Iterator[Any]:
    """Its own server (float32, 1024 tokens), or the one at GRPO_AGENT_TEST_WARM_VLLM_URL: a
    server you started on that model and let the tests change. Yields `base_url`, `model_path`."""
    from grpo_agent.sampler.server import ManagedVLLMServer
    from grpo_agent.testing.warmup import build_tool_warmed_model

    url = os.environ.get(WARM_URL_ENV)
    if url:
        yield SimpleNamespace(base_url=url.rstrip("/"), model_path=build_tool_warmed_model())
        return
    with ManagedVLLMServer(build_tool_warmed_model(), dtype="float32", max_model_len=1024,
                           enforce_eager=True, log_path=log_dir / "server.log") as server:
        yield server
