"""`grpo-agent --help` wall time against a bare `python -c pass` (target: help under 1 s).

Both are started the same way (fresh interpreter, same venv), alternately, so machine load
affects both; prints one JSON line per command and a summary line with the median ratio.
CPU seconds (user + sys of the child) are reported too: on a loaded machine they say more
than wall time.
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = 7
COMMANDS = {
    "python_pass": [sys.executable, "-c", "pass"],
    "grpo_agent_help": [str(Path(sys.executable).parent / "grpo-agent"), "--help"],
    "grpo_agent_version": [str(Path(sys.executable).parent / "grpo-agent"), "--version"],
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `command`."""
    cpu_start, start = _children_cpu_s(), time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    return time.perf_counter() - start, _children_cpu_s() - cpu_start


def main() -> None:
    for command in COMMANDS.values():
        timed_run(command)  # warm the file cache
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(RUNS):
        for name, command in COMMANDS.items():
            wall, used = timed_run(command)
            times[name].append(wall)
            cpu[name].append(used)
    medians = {name: statistics.median(values) for name, values in times.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    for name, values in times.items():
        print(json.dumps({"command": name, "median_s": round(medians[name], 3),
                          "min_s": round(min(values), 3),
                          "cpu_median_s": round(cpu_medians[name], 3), "runs": RUNS}))
    print(json.dumps({
        "summary": "cli_startup",
        "help_median_s": round(medians["grpo_agent_help"], 3),
        "help_cpu_median_s": round(cpu_medians["grpo_agent_help"], 3),
        "python_pass_median_s": round(medians["python_pass"], 3),
        "help_over_python_ratio": round(medians["grpo_agent_help"] / medians["python_pass"], 2),
        "help_under_1s": medians["grpo_agent_help"] < 1.0,
    }))


if __name__ == "__main__":
    main()
