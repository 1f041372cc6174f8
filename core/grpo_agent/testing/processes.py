"""Process checks for tests of what outlives what."""
from __future__ import annotations

import os
import time


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
