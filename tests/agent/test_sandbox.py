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


@pytest.mark.parametrize("name", ["../grpo-escape-{pid}.py", "/tmp/grpo-escape-{pid}.py", "sub/../../grpo-escape-{pid}.py"])
def test_a_file_name_pointing_outside_the_work_folder_is_refused(name):
    name = name.format(pid=os.getpid())
    target = Path("/tmp") / f"grpo-escape-{os.getpid()}.py"
    try:
        with pytest.raises(ValueError, match="points outside the work folder"):
            run_python("print('ran')", files={name: "written by the caller"}, limits=FAST)
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_files_sit_beside_main_py_where_the_program_can_import_and_write_them():
    """`files` are importable (the folder is on sys.path despite `python -I`), owned by the
    program (it may rewrite them), and never replace the program itself."""
    files = {"helper.py": "VALUE = 41\n", "data/notes.txt": "a", "main.py": "print('not the program')"}
    code = (
        "import helper\n"
        "open('data/notes.txt', 'a').write('b')\n"
        "print(helper.VALUE + 1, open('data/notes.txt').read())\n"
    )
    result = run_python(code, files=files, limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["42", "ab"]


def test_the_program_runs_as_nobody_under_exactly_the_limits_it_was_given():
    """Each SandboxLimits field reaches its rlimit (a wrong mapping would not show in the
    coarse bomb tests), and no group of the trainer (root) is kept."""
    limits = SandboxLimits(timeout_s=5.0, cpu_s=3, memory_mb=300, max_processes=17,
                           max_file_bytes=123 * 1024, max_open_files=29)
    code = (
        "import json, os, resource\n"
        "names = ['CPU', 'AS', 'NPROC', 'FSIZE', 'NOFILE', 'CORE']\n"
        "print(json.dumps({n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in names}))\n"
        "print(json.dumps([os.getuid(), os.getgid(), os.getgroups(), os.environ['HOME'] == os.getcwd()]))\n"
    )
    result = run_python(code, limits=limits)
    assert result.ok, result.stderr
    rlimits, identity = (json.loads(line) for line in result.stdout.splitlines())
    assert rlimits == {
        "CPU": [3, 3], "AS": [300 * 1024 * 1024] * 2, "NPROC": [17, 17],
        "FSIZE": [123 * 1024] * 2, "NOFILE": [29, 29], "CORE": [0, 0],
    }
    if os.getuid() == 0:
        assert identity == [65534, 65534, [], True]


def test_the_cpu_limit_kills_a_busy_program_before_the_wall_clock_does():
    """As PID 1 of its namespace the program ignores SIGXCPU, so the hard limit, equal to
    `cpu_s`, is what stops it (SIGKILL), and the result names the signal. (With the hard limit a
    second above, a 1 s limit let the program run about 3 s.)"""
    result = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=8.0, cpu_s=1))
    assert not result.ok and not result.timed_out
    assert result.duration_s < 6  # the hard limit itself is held by the rlimits test above
    assert result.describe_failure().startswith("The program was killed by signal SIGKILL")


def test_output_of_exactly_the_cap_is_not_marked_truncated():
    code = f"import sys\nsys.stdout.write('x' * {FAST.max_output_bytes})"
    result = run_python(code, limits=FAST)
    assert result.ok and not result.truncated and len(result.stdout) == FAST.max_output_bytes
    assert run_python_or_raise(code, limits=FAST) == "x" * FAST.max_output_bytes


def test_a_flood_is_read_back_at_most_one_byte_past_the_cap(monkeypatch):
    """The parent reads the output files with a bounded read: a program that writes gigabytes
    must not make the trainer load them."""
    import builtins

    from grpo_agent import sandbox

    reads = []

    class CountingFile:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def read(self, size=-1):
            data = self.handle.read(size)
            reads.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def counting_open(*args, **kwargs):
        return CountingFile(builtins.open(*args, **kwargs))

    monkeypatch.setattr(sandbox, "open", counting_open, raising=False)
    result = run_python("import sys\nsys.stdout.write('x' * 1_000_000)\nsys.stderr.write('e' * 1_000_000)",
                        limits=FAST)
    assert result.truncated and len(result.stdout) == len(result.stderr) == FAST.max_output_bytes
    assert reads and max(reads) <= FAST.max_output_bytes + 1


def test_the_work_and_log_folders_are_deleted_even_when_a_file_name_is_refused(monkeypatch):
    import tempfile

    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    assert run_python("print(1)", limits=FAST).ok
    with pytest.raises(ValueError):
        run_python("print(1)", files={"../x": ""}, limits=FAST)
    assert len(made) == 4 and not [folder for folder in made if Path(folder).exists()]


def test_without_namespaces_the_run_is_refused_unless_isolation_is_waived(tmp_path, monkeypatch):
    """A kernel or container that forbids namespaces must not silently run model code
    unconfined. Dropping CAP_SYS_ADMIN (setpriv) makes unshare() fail like such a kernel."""
    import shutil

    from grpo_agent import sandbox

    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to take the namespace capability away")
    python = sandbox.sandbox_python()
    wrapper = tmp_path / "python-without-namespaces"
    wrapper.write_text(f'#!/bin/sh\nexec setpriv --bounding-set -sys_admin {python} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(sandbox, "sandbox_python", lambda: str(wrapper))
    with pytest.raises(SandboxError, match=r"cannot create namespaces.*require_isolation=False"):
        run_python("print('ran unconfined')", limits=FAST)
    waived = run_python("import os\nprint('ran', os.getuid())", limits=SandboxLimits(require_isolation=False))
    assert waived.ok and waived.stdout.split() == ["ran", "65534"]


def test_a_program_may_start_one_subprocess_after_another():
    """As root the program itself is PID 1 of its namespace. Were it only the parent of the
    namespace's first process, every fork after that first child exits would fail (ENOMEM)."""
    code = "import subprocess\nfor _ in range(3):\n    subprocess.run(['true'], check=True)\nprint('done')"
    result = run_python(code, limits=FAST)
    assert result.ok and result.stdout.strip() == "done", result.stderr
