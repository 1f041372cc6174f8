"""Run untrusted, model-written Python in a confined subprocess.

Design decision: layered, stdlib-only confinement that works on a plain Linux box without
containers. Each run gets a throwaway work folder and a fresh process session; the child
(`_sandbox_boot.py`) enters a new network namespace (no interfaces: no network) and, when
started as root, a PID namespace, drops to user `nobody` (so file permissions, not goodwill,
keep it away from the trainer's files), sets rlimits (CPU, address space, processes, file
size, open files, no core dumps) and installs an audit hook that refuses sockets and writes
outside the folder as a second layer. The parent enforces a wall-clock timeout by killing
the whole process group, reads at most `max_output_bytes` of each stream from files (never
pipes, so a flood cannot grow the parent's memory) and deletes the folder. docs/agents.md
lists what is and is not guaranteed.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BOOT_SCRIPT = Path(__file__).with_name("_sandbox_boot.py")
ISOLATION_FAILED_EXIT = 97
_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")


class SandboxError(RuntimeError):
    """A sandboxed run failed (timeout, resource limit, blocked action or a non-zero exit)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. CPU time is also capped by the wall-clock `timeout_s`."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    max_processes: int = 64
    max_file_bytes: int = 16 * 1024 * 1024
    max_open_files: int = 64
    max_output_bytes: int = 8192
    require_isolation: bool = True


@dataclass
class SandboxResult:
    """What came back from one run; `ok` is a clean exit within the limits."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe_failure(self) -> str:
        """One line naming what went wrong, then the (truncated) stderr tail."""
        if self.timed_out:
            reason = "timed out (wall-clock limit) and was killed"
        elif self.returncode is not None and self.returncode < 0:
            reason = f"was killed by signal {signal.Signals(-self.returncode).name}"
        elif self.returncode is not None and self.returncode > 128:
            reason = f"was killed by signal {signal.Signals(self.returncode - 128).name}"
        else:
            reason = f"exited with status {self.returncode}"
        tail = self.stderr.strip().splitlines()[-5:]
        return f"The program {reason}." + ("\n" + "\n".join(tail) if tail else "")


def _world_executable(path: str) -> bool:
    """True when `nobody` can run `path`: every folder on its real path is world-searchable."""
    real = Path(os.path.realpath(path))
    if not real.exists() or not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)


@functools.lru_cache(maxsize=1)
def sandbox_python() -> str:
    """An interpreter the sandbox can run after dropping to `nobody` (the current one if possible)."""
    if os.getuid() != 0 or _world_executable(sys.executable):
        return sys.executable
    for candidate in _SYSTEM_PYTHONS:
        if _world_executable(candidate):
            return candidate
    raise SandboxError(
        f"No Python interpreter is usable by user 'nobody' ({sys.executable} sits in a private "
        "folder and none of " + ", ".join(_SYSTEM_PYTHONS) + " exists): install a system python3."
    )


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_python(
    code: str, *, files: dict[str, str] | None = None, limits: SandboxLimits = SandboxLimits(), stdin: str = ""
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh work folder (plus `files`), confined as described above."""
    workdir = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    logs = Path(tempfile.mkdtemp(prefix="grpo-sandbox-logs-"))
    try:
        for name, text in {**(files or {}), "main.py": code}.items():
            target = (workdir / name).resolve()
            if workdir.resolve() not in target.parents:
                raise ValueError(f"Sandbox file name {name!r} points outside the work folder.")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        boot_limits = {
            "cpu_s": max(1, int(limits.cpu_s)), "memory_mb": limits.memory_mb,
            "max_processes": limits.max_processes, "max_file_bytes": limits.max_file_bytes,
            "max_open_files": limits.max_open_files, "require_isolation": limits.require_isolation,
        }
        command = [sandbox_python(), "-I", "-B", str(BOOT_SCRIPT), str(workdir), json.dumps(boot_limits)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        started = time.perf_counter()
        with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
            process = subprocess.Popen(
                command, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                start_new_session=True,
            )
            timed_out = False
            try:
                process.communicate(stdin.encode(), timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process)  # also reaps anything the program left running
                process.wait()
        stdout, cut_out = _read_capped(logs / "out", limits.max_output_bytes)
        stderr, cut_err = _read_capped(logs / "err", limits.max_output_bytes)
        if process.returncode == ISOLATION_FAILED_EXIT and "cannot create namespaces" in stderr:
            raise SandboxError(stderr.strip() + " (set SandboxLimits(require_isolation=False) to run without)")
        return SandboxResult(
            process.returncode, stdout, stderr, timed_out, cut_out or cut_err, time.perf_counter() - started
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


def run_python_or_raise(code: str, **kwargs) -> str:
    """`run_python` for tools: stdout on success, else `SandboxError` (a failed tool call)."""
    result = run_python(code, **kwargs)
    if not result.ok:
        raise SandboxError(result.describe_failure())
    return result.stdout + ("\n[output truncated]" if result.truncated else "")
