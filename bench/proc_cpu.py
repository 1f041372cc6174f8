"""CPU counters of local processes, read through /proc (Linux).

Shared by the benches that report each process's CPU share (`bench/pipeline.py`): shares of
named processes and vLLM's engine-core processes (utime + stime and process trees come from
`grpo_agent.testing.processes`, which tests use too). (Priorities:
`grpo_agent.sampler.cpu_cores.lower_priority`.)
"""
from __future__ import annotations

import time
from pathlib import Path

from grpo_agent.testing.processes import cpu_seconds, descendants


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
