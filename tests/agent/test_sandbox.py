"""Hostile programs are contained by the sandbox and come back as failed tool calls."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.sandbox import SandboxError, SandboxLimits, run_python, run_python_or_raise

sys.path.insert(0, str(Path(__file__).parents[1] / "faults"))
from fault_helpers import record_fault_to_outcome

FAST = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=256, max_processes=32)


def test_a_normal_program_runs_in_its_own_throwaway_folder():
    result = run_python("import os; open('a.txt', 'w').write('hi'); print(open('a.txt').read(), os.getcwd())", limits=FAST)
    assert result.ok, result.stderr
    text, cwd = result.stdout.split()
    assert text == "hi" and cwd.startswith("/tmp/grpo-sandbox-")
    assert not Path(cwd).exists()  # deleted afterwards


def test_infinite_loop_is_killed_at_the_time_limit(record_property):
    started = time.perf_counter()
    result = run_python("while True:\n    pass", limits=FAST)
    # From the call (the loop starts with the program) to its result: killed, cleaned up.
    record_fault_to_outcome(record_property, time.perf_counter() - started, FAST.timeout_s)
    assert not result.ok and (result.timed_out or result.returncode != 0)
    assert time.perf_counter() - started < FAST.timeout_s + 2
    assert "timed out" in result.describe_failure() or "signal" in result.describe_failure()


def test_memory_bomb_hits_the_address_space_limit():
    result = run_python("x = bytearray(8 * 1024**3)", limits=FAST)
    assert not result.ok and "MemoryError" in result.stderr


@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
        # A child interpreter has no audit hook: the network namespace still stops it.
        (
            "import subprocess, sys\n"
            "r = subprocess.run(['python3', '-c', 'import socket; socket.create_connection((\"127.0.0.1\", 22), timeout=1)'])\n"
            "sys.exit(r.returncode)"
        ),
    ],
)
def test_network_connections_fail(code):
    result = run_python(code, limits=FAST)
    assert not result.ok
    assert "network access is blocked" in result.stderr or "Network is unreachable" in result.stderr


@pytest.mark.parametrize(
    "code",
    [
        "open({target!r}, 'w').write('pwned')",
        # A shell has no audit hook: file permissions (user nobody) still stop it.
        "import subprocess, sys\nsys.exit(subprocess.run(['sh', '-c', 'echo pwned > {target}']).returncode)",
    ],
)
def test_writing_outside_the_work_folder_fails(tmp_path, code):
    target = tmp_path / "trainer_file.txt"
    target.write_text("precious")
    result = run_python(code.format(target=str(target)), limits=FAST)
    assert not result.ok
    assert target.read_text() == "precious"


def test_fork_bomb_is_contained_and_leaves_no_processes():
    before = set(os.listdir("/proc"))
    result = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert not result.ok
    time.sleep(0.5)
    leftovers = [pid for pid in set(os.listdir("/proc")) - before if pid.isdigit() and _is_sandbox(pid)]
    assert leftovers == []


def _is_sandbox(pid: str) -> bool:
    try:
        return b"_sandbox_boot" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_output_is_truncated():
    result = run_python("print('x' * 100_000)", limits=FAST)
    assert result.ok and result.truncated and len(result.stdout) == FAST.max_output_bytes
    assert run_python_or_raise("print('y' * 100_000)", limits=FAST).endswith("[output truncated]")


def test_failures_raise_a_sandbox_error_naming_the_cause():
    with pytest.raises(SandboxError, match="(?s)exited with status 1.*ZeroDivisionError"):
        run_python_or_raise("1 / 0", limits=FAST)


def run_code(code: str) -> str:
    """Run Python code in the sandbox.

    Args:
        code: The program.

    Returns:
        Its standard output.
    """
    return run_python_or_raise(code, limits=FAST)


HOSTILE = [
    "while True:\n    pass",
    "x = bytearray(8 * 1024**3)",
    "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
    "open('/work/main/PWNED', 'w').write('x')",
    "import os\nwhile True:\n    os.fork()",
]


def test_hostile_programs_are_failed_tool_calls_in_the_tool_loop(scripted_loop):
    calls = "".join(
        "<tool_call>\n" + json.dumps({"name": "run_code", "arguments": {"code": code}}) + "\n</tool_call>"
        for code in HOSTILE
    )
    loop = scripted_loop([calls, "I give up."])
    rollout = asyncio.run(run_tool_loop(loop, [{"role": "user", "content": "hack"}], [run_code], group_id=0))
    assert rollout.tool_call_count == 5 and rollout.tool_failure_count == 5
    assert rollout.metrics["tools/run_code/failure_count"] == [5.0]
    for message in rollout.completion:
        if message["role"] == "tool":
            assert "SandboxError" in json.loads(message["content"])["error"]
    assert not Path("/work/main/PWNED").exists()
