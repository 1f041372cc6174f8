"""Hostile programs in the coding sandbox, beyond those of tests/agent/test_sandbox.py.

Each case runs one program that attacks the trainer (its files, environment, processes,
disk or the wall clock) and checks that the attack failed and left nothing behind. The
trainer here is this test process: it runs as root, the sandboxed program as `nobody` in its
own network and PID namespaces (grpo_agent/sandbox.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_agent.sandbox import SandboxLimits, run_python

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome

FAST = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=256, max_processes=32, max_file_bytes=1024 * 1024)
SECRET = "grpo-fault-secret-7c1e"


@pytest.fixture
def private_file(tmp_path):
    """A trainer file only its owner may read (a token, a checkpoint), in a world-searchable folder."""
    folder = Path("/tmp") / f"grpo-fault-{os.getpid()}"
    folder.mkdir(mode=0o755, exist_ok=True)
    path = folder / "secret.txt"
    path.write_text(SECRET)
    path.chmod(0o600)
    yield path
    path.unlink(missing_ok=True)
    folder.rmdir()


def test_sleeping_past_the_limit_is_killed(record_property):
    started = time.perf_counter()
    result = run_python("import time\ntime.sleep(600)", limits=FAST)
    # From the call (the sleep starts with the program) to its result: killed, cleaned up.
    record_fault_to_outcome(record_property, time.perf_counter() - started, FAST.timeout_s)
    assert result.timed_out and not result.ok
    assert "timed out" in result.describe_failure()


def test_reading_a_private_trainer_file_is_refused(private_file):
    result = run_python(f"print(open({str(private_file)!r}).read())", limits=FAST)
    assert not result.ok and "PermissionError" in result.stderr
    assert SECRET not in result.stdout


def test_the_trainers_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("GRPO_FAULT_TOKEN", SECRET)
    code = (
        "import os\n"
        "print(sorted(os.environ.items()))\n"
        f"print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
    )
    result = run_python(code, limits=FAST)
    assert SECRET not in result.stdout
    assert "GRPO_FAULT_TOKEN" not in result.stdout
    assert not result.ok and "PermissionError" in result.stderr  # /proc/PID/environ of root


def test_signalling_the_trainer_and_its_processes_fails():
    """Signal 0 probes permission without delivering: a broken sandbox fails this test, no harm done.

    Never test with kill(-1) or a real signal to the trainer: as root outside a PID namespace
    that kills every process on the machine.
    """
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        code = (
            "import os, signal\n"
            f"for pid in [p for p in (os.getppid(), {os.getpid()}, {bystander.pid}) if p > 0]:\n"
            "    try:\n"
            "        os.kill(pid, 0)\n"
            "        print('may signal', pid)\n"
            "    except (PermissionError, ProcessLookupError) as err:\n"
            "        print('refused', pid, type(err).__name__)\n"
            f"os.kill({bystander.pid}, signal.SIGKILL)\n"
        )
        result = run_python(code, limits=FAST)
        assert "may signal" not in result.stdout, result.stdout
        assert not result.ok and bystander.poll() is None  # the bystander still runs
    finally:
        bystander.kill()
        bystander.wait()


def test_one_huge_file_stops_at_the_file_size_limit():
    code = "with open('fill', 'wb') as f:\n    for _ in range(1000):\n        f.write(b'x' * 1024 * 1024)\n"
    result = run_python(code, limits=FAST)
    assert not result.ok and "File too large" in result.stderr


def test_files_left_in_the_work_folder_are_deleted():
    code = (
        "import os\n"
        "for i in range(8):\n"
        "    open(f'f{i}', 'wb').write(b'x' * 512 * 1024)\n"
        "print(os.getcwd())\n"
    )
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    assert not Path(result.stdout.strip()).exists()


def test_huge_stderr_is_truncated():
    result = run_python("import sys\nsys.stderr.write('e' * 10_000_000)", limits=FAST)
    assert result.truncated and len(result.stderr) == FAST.max_output_bytes


@pytest.mark.parametrize(
    "code",
    [
        # A daemon: double fork and a new session, so killing the process group misses it.
        ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.execvp('sleep', ['sleep', '{tag}'])\n    os._exit(0)\nprint('parent done')\n"),
        # A plain child left running when the program returns.
        "import subprocess\nsubprocess.Popen(['sleep', '{tag}'])\nprint('parent done')\n",
    ],
    ids=["setsid-daemon", "orphan-child"],
)
def test_a_process_left_running_does_not_outlive_the_call(code):
    tag = f"600.{os.getpid()}"  # a sleep only this test starts

    def left_running() -> list[str]:
        found = subprocess.run(["pgrep", "-f", f"sleep {tag}"], check=False, capture_output=True, text=True)
        return found.stdout.split()

    result = run_python(code.format(tag=tag), limits=FAST)
    assert result.ok and "parent done" in result.stdout, result.stderr
    deadline = time.monotonic() + 5
    while left_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = left_running()
    for pid in survivors:  # a broken sandbox must not leave them running after the test
        os.kill(int(pid), signal.SIGKILL)
    assert survivors == []


def test_too_many_open_files_is_refused():
    result = run_python("fs = [open(f'f{i}', 'w') for i in range(10_000)]", limits=FAST)
    assert not result.ok and "Too many open files" in result.stderr


def test_deleting_or_linking_out_of_the_folder_is_blocked(private_file):
    code = (
        f"import os\n"
        f"os.symlink({str(private_file)!r}, 'link')\n"
        f"open('link', 'w').write('pwned')\n"
    )
    assert not run_python(code, limits=FAST).ok
    assert not run_python(f"import os\nos.remove({str(private_file)!r})", limits=FAST).ok
    shell = f"import subprocess, sys\nsys.exit(subprocess.run(['rm', '-f', {str(private_file)!r}]).returncode)"
    assert not run_python(shell, limits=FAST).ok
    assert private_file.read_text() == SECRET


@pytest.mark.parametrize(
    "code, error",
    [
        ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "ValueError"),
        ("import os\nos.setuid(0)", "PermissionError"),
    ],
    ids=["raise-own-limits", "become-root"],
)
def test_escalation_is_refused(code, error):
    result = run_python(code, limits=FAST)
    assert not result.ok and error in result.stderr


def _sleeps_left(tag: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"sleep {tag}"], check=False, capture_output=True, text=True)
    return found.stdout.split()


def test_a_program_killed_at_the_time_limit_leaves_no_process_behind():
    """On timeout the whole group goes: the program and the children it started, promptly."""
    tag = f"601.{os.getpid()}"
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', '{tag}'])\ntime.sleep(30)\n"
    started = time.perf_counter()
    result = run_python(code, limits=FAST)
    assert result.timed_out and time.perf_counter() - started < FAST.timeout_s + 3
    deadline = time.monotonic() + 5
    while _sleeps_left(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _sleeps_left(tag)
    for pid in survivors:  # a broken sandbox must not leave them running after the test
        os.kill(int(pid), signal.SIGKILL)
    assert survivors == []


def test_a_file_only_the_trainers_group_may_read_is_refused(private_file):
    """Dropping to `nobody` drops root's groups too (setgroups and setgid, not only setuid)."""
    private_file.chmod(0o640)
    result = run_python(f"print(open({str(private_file)!r}).read())", limits=FAST)
    assert not result.ok and "PermissionError" in result.stderr
    assert SECRET not in result.stdout


@pytest.mark.parametrize(
    "code",
    [
        "open({target!r}, 'w').write('x')",
        "import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
        "import os\nopen('mine', 'w').write('x')\nos.rename('mine', {target!r})",
        "import os\nos.mkdir({target!r})",
        # A shell may make the link (no audit hook there); Python must not write through it.
        "import subprocess\nsubprocess.run(['ln', '-s', {target!r}, 'link'], check=True)\nopen('link', 'w').write('x')",
    ],
    ids=["open", "os-open", "rename-out", "mkdir", "through-a-symlink"],
)
def test_python_cannot_write_into_a_world_writable_folder_outside_its_own(code):
    """/tmp is writable by `nobody`, so file permissions do not stop these: the audit hook must."""
    target = Path("/tmp") / f"grpo-fault-outside-{os.getpid()}"
    try:
        result = run_python(code.format(target=str(target)), limits=FAST)
        assert not result.ok and "outside the work folder is blocked" in result.stderr, result.stderr
        assert not target.exists() and not target.is_symlink()
    finally:
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        else:
            target.unlink(missing_ok=True)


def test_a_folder_that_merely_starts_with_the_work_folders_name_is_outside_it():
    """`/tmp/grpo-sandbox-abc-x` is not inside `/tmp/grpo-sandbox-abc`: a prefix test on the
    path string would let the program write next to its folder."""
    tag = f"-sibling-{os.getpid()}"
    result = run_python(f"import os\nopen(os.getcwd() + {tag!r}, 'w').write('x')", limits=FAST)
    left = list(Path("/tmp").glob(f"grpo-sandbox-*{tag}"))
    for path in left:
        path.unlink()
    assert not result.ok and "outside the work folder is blocked" in result.stderr
    assert left == []


def test_a_unix_socket_of_the_trainer_is_refused_in_the_program():
    """The network namespace does not cover sockets bound to a path; in the program's own
    interpreter the audit hook refuses every socket."""
    import socket

    folder = Path("/tmp") / f"grpo-fault-sock-{os.getpid()}"
    folder.mkdir(mode=0o755)
    path = folder / "trainer.sock"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        path.chmod(0o777)
        server.listen()
        code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\ns.sendall(b'pwned')"
        result = run_python(code, limits=FAST)
        assert not result.ok and "network access is blocked" in result.stderr, result.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
        path.unlink(missing_ok=True)
        folder.rmdir()


def test_a_trainer_with_supplementary_groups_does_not_pass_them_on():
    """A root trainer often sits in groups (docker, a data group); the program must hold none."""
    if os.getuid() != 0:
        pytest.skip("only root switches the program to nobody")
    script = (
        "import os\n"
        "os.setgroups([0, 4242])\n"
        "from grpo_agent.sandbox import SandboxLimits, run_python\n"
        "r = run_python('import os; print(os.getgroups(), os.getgid())', limits=SandboxLimits(timeout_s=10))\n"
        "print(r.stdout.strip(), r.stderr.strip())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] 65534"
