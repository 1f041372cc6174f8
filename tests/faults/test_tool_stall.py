"""A tool that hangs past its stage deadline, through the real tool loop (rendering, parsing,
execution; only the sampler is scripted): the stall report names the tool and the rollout
ends with `StageStalled` for the loop to drop and count. A sync tool whose calls time out and
never return, on a tiny pool: once they hold most of its threads the run stops naming it."""
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
from grpo_agent.rollout.agent import execute_tool_call, run_tool_loop
from grpo_agent.rollout.concurrency import RolloutThreadPool, ToolThreadsHeldError
from grpo_agent.rollout.tool_calls import ToolCall
from grpo_agent.types import TurnRecord

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome

RELEASE = threading.Event()
LOOKING_UP = threading.Event()  # a `lookup` call runs in its thread


def lookup(key: str) -> str:
    """Look a key up in a remote store that never answers.

    Args:
        key: the key.
    """
    LOOKING_UP.set()
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


async def async_lookup(key: str) -> str:
    """Look a key up, asynchronously, in a remote store that never answers.

    Args:
        key: the key.
    """
    await asyncio.sleep(600)
    return key


def _held_message(held: int, size: int) -> str:
    return (f"Sync tool 'lookup' timed out (tool_timeout_s=0.05) and its calls have not returned: "
            f"timed-out calls ('lookup' {held}) hold {held} of the {size} threads "
            "(max_concurrent_rollouts) that tools, environments and rewards share, and a thread "
            "cannot be stopped, so rollouts would wait for a thread until no_progress_timeout. "
            "Make 'lookup' return within tool_timeout_s (a timeout on what it waits for), or make "
            "it `async def` (a timed-out async call is cancelled and holds no thread).")


@pytest.mark.timeout(30)
def test_a_sync_tool_whose_timed_out_calls_hold_most_of_the_pool_stops_the_run_naming_it(
        record_property):
    """A sync tool that always hangs took the rollout pool one timed-out call at a time (a
    thread cannot be stopped); then every rollout waited for a thread and the run ended only at
    no_progress_timeout (30 min) without naming the tool. Now the call that leaves timed-out
    calls holding more than half the pool raises, naming the tool and the fix; the threads
    count again once their calls return, and an async tool's timeout holds none."""
    pool = RolloutThreadPool(3, "max_concurrent_rollouts")
    tools = {"lookup": lookup, "async_lookup": async_lookup}

    def call_tool(name):
        return asyncio.run(execute_tool_call(ToolCall(name, {"key": "x"}), tools, pool, 0.05))

    RELEASE.clear()
    try:
        assert call_tool("async_lookup").failed and pool.held() == {}
        first = call_tool("lookup")  # 1 of 3 threads held: the rollout goes on
        assert first.failed and json.loads(first.content) == {
            "error": "Tool 'lookup' timed out after 0.05 s."}
        assert pool.held() == {"lookup": 1}
        started = time.monotonic()
        with pytest.raises(ToolThreadsHeldError) as held:  # 2 of 3: more than half
            call_tool("lookup")
        record_fault_to_outcome(record_property, time.monotonic() - started, 0.05)
        assert str(held.value) == _held_message(2, 3)
    finally:
        RELEASE.set()
        pool.shutdown(wait=True)
    assert pool.held() == {}  # the calls returned: their threads are free again


@pytest.mark.timeout(30)
def test_a_sync_call_cancelled_with_its_rollout_counts_toward_the_held_threads():
    """A rollout cancelled mid-call (its group stalled or dropped) leaves the sync call
    running in its thread just as a timeout does, but only timed-out calls were counted: here
    one cancelled and one timed-out call hold 2 of 3 threads and nothing stopped the run."""
    pool = RolloutThreadPool(3, "max_concurrent_rollouts")
    tools = {"lookup": lookup}

    async def cancel_mid_call():
        task = asyncio.create_task(execute_tool_call(ToolCall("lookup", {"key": "x"}), tools, pool, 30))
        await asyncio.to_thread(LOOKING_UP.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    RELEASE.clear()
    LOOKING_UP.clear()
    try:
        asyncio.run(cancel_mid_call())
        assert pool.held() == {"lookup": 1}
        with pytest.raises(ToolThreadsHeldError) as held:  # 1 cancelled + 1 timed out of 3
            asyncio.run(execute_tool_call(ToolCall("lookup", {"key": "x"}), tools, pool, 0.05))
        assert str(held.value).startswith(
            "Sync tool 'lookup' timed out (tool_timeout_s=0.05) and its calls have not returned: "
            "timed-out or cancelled calls ('lookup' 2) hold 2 of the 3 threads"), str(held.value)
    finally:
        RELEASE.set()
        pool.shutdown(wait=True)
    assert pool.held() == {}


@pytest.mark.timeout(30)
def test_through_the_tool_loop_a_one_thread_pool_stops_at_the_first_timed_out_call():
    """The engine's pool has `max_concurrent_rollouts` threads; with one, the first timed-out
    call of a hanging sync tool leaves none for anything else (the next turn's rendering
    waited for it forever), and the rollout raises instead."""
    from grpo_agent.testing import build_tiny_model
    from transformers import AutoTokenizer

    loop = OneTurnLoop(AutoTokenizer.from_pretrained(build_tiny_model()), stalls=None)
    loop.tool_executor.shutdown(wait=False)
    loop.tool_executor = RolloutThreadPool(1, "max_concurrent_rollouts")
    loop.config.tool_timeout_s = 0.05
    RELEASE.clear()
    try:
        with pytest.raises(ToolThreadsHeldError) as held:
            asyncio.run(run_tool_loop(loop, [{"role": "user", "content": "find x"}], [lookup], 0))
    finally:
        RELEASE.set()
        loop.tool_executor.shutdown(wait=False)
    assert str(held.value) == _held_message(1, 1)
