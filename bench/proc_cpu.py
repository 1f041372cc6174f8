"""CPU counters of local processes, read through /proc (Linux).

Shared by the benches that report each process's CPU share (`bench/pipeline.py`): utime +
stime of a process or one thread, a process tree, vLLM's engine-core processes. (Priorities:
`grpo_agent.sampler.cpu_cores.lower_priority`.)
"""
from __future__ import annotations

import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (or one of its threads), in seconds; 0 if it is gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


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


class CpuShares:
    """CPU seconds per named process between two readings, as a share of one core."""

    def __init__(self, pids: dict[str, tuple[int, int | None] | list[int]]) -> None:
        self.pids = pids
        self._last = self._read()
        self._last_t = time.perf_counter()

    def _read(self) -> dict[str, float]:
        values = {}
        for name, ids in self.pids.items():
            if isinstance(ids, tuple):
                values[name] = cpu_seconds(*ids)
            else:
                values[name] = sum(cpu_seconds(p) for p in ids)
        return values

    def shares(self) -> dict[str, float]:
        now, values = time.perf_counter(), self._read()
        wall = max(now - self._last_t, 1e-9)
        shares = {name: round((values[name] - self._last[name]) / wall, 3) for name in values}
        self._last, self._last_t = values, now
        return shares


def server_processes(server_pid: int) -> dict[str, list[int]]:
    """The API server and its engine-core process(es): vLLM names the engine `VLLM::EngineCore`."""
    engine = []
    for pid in descendants(server_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        if "Engine" in name or "VLLM" in name:
            engine.append(pid)
    return {"api_server": [server_pid], "engine_core": engine}
