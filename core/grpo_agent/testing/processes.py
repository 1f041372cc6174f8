"""Process checks for tests (and benches): what outlives what, what a process tree costs."""
from __future__ import annotations

import os
import time
from pathlib import Path


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a dead child nobody reaped still answers `kill(pid, 0)`)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def gone_within(pid: int, seconds: float) -> bool:
    """Whether `pid` stops running within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.1)
    return False


def kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (or one of its threads), in seconds; 0 if it is gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def left_in_session(session: int, guard_s: float = 30.0) -> list[str]:
    """The command lines of processes still in process group `session` once `guard_s` passed
    (multiprocessing's resource tracker cleans up for a moment after its parent is gone)."""
    deadline = time.monotonic() + guard_s
    while True:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == session and fields[0] != "Z":  # pgrp, not a zombie
                    left.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
            except (OSError, IndexError):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                children = [int(c) for c in task.read_text().split()]
            except FileNotFoundError:
                continue
            found += children
            frontier += children
    return found
