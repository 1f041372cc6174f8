"""A tool that hangs past its stage deadline, through the real tool loop (rendering, parsing,
execution; only the sampler is scripted): the stall report names the tool and the rollout
ends with `StageStalled` for the loop to drop and count."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpo_agent import stall
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.types import TurnRecord

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome

RELEASE = threading.Event()


def lookup(key: str) -> str:
    """Look a key up in a remote store that never answers.

    Args:
        key: the key.
    """
    RELEASE.wait(600)
    return key


class OneTurnLoop:
    """The seam `run_tool_loop` talks to; the model calls `lookup` once."""

    def __init__(self, tokenizer, stalls):
        self.tokenizer, self.stalls = tokenizer, stalls
        self.config = SimpleNamespace(chat_template_kwargs=None, max_tool_calling_iterations=None,
                                      max_completion_length=64, tool_timeout_s=300.0)
        self.tool_executor = ThreadPoolExecutor(2)

    async def generate_one_turn(self, prompt_ids):
        text = '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>'
        output = self.tokenizer.encode(text + self.tokenizer.eos_token, add_special_tokens=False)
        return TurnRecord(prompt_ids, output, [-0.1] * len(output), finish_reason="stop")


def test_a_hung_tool_is_named_and_its_rollout_ends(tmp_path, record_property):
    from grpo_agent.testing import build_tiny_model
    from transformers import AutoTokenizer

    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             stall_timeouts={"tool": 1})
    watch = stall.StallWatch(config, "worker").start()
    loop = OneTurnLoop(AutoTokenizer.from_pretrained(build_tiny_model()), watch)
    started = time.monotonic()  # the rollout's first turn calls the tool that hangs
    try:
        with pytest.raises(stall.StageStalled, match="stage 'tool' \\(tool=lookup\\)"):
            asyncio.run(run_tool_loop(loop, [{"role": "user", "content": "find x"}], [lookup], 0))
        record_fault_to_outcome(record_property, time.monotonic() - started, 1.0)
    finally:
        RELEASE.set()
        loop.tool_executor.shutdown(wait=False)
        watch.stop()
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["stage"] == "tool" and report["tool"] == "lookup"
    assert "lookup" in report["stacks"]["worker"] and "run_tool_loop" in report["stage_stack"]
