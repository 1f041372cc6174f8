"""The stall report: what `stall_report.json` holds, the log's summary, and the stacks in it.

Split from `stall.py` (which keeps the stages, their deadlines and the monitor that acts on
them) because writing a report is its own job: gather the watch's context, every stage in
flight, this process's thread stacks, a stuck task's await chain and the peers' stacks (each
peer dumps its own with `faulthandler` on SIGUSR2 into a file the report reads back). It
takes the watch and the late stage as plain objects, so it never imports `stall`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("grpo_agent.stall")  # the log lines read as the watch's own

STACK_SIGNAL = signal.SIGUSR2
PEER_DUMP_WAIT_S = 1.0


def write(watch: Any, entry: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Write `watch.report_name` in its output dir for the late stage `entry`, log a readable
    summary, and append the report to `watch.stalls`; returns it."""
    now = time.monotonic()
    try:
        context = watch.context()
    except Exception as error:  # noqa: BLE001 - the report must still be written
        context = {"error": f"context unavailable: {error!r}"}
    if entry.report_extra is not None:
        try:
            extra = {**entry.report_extra(), **extra}
        except Exception as error:  # noqa: BLE001
            extra = {"report_extra_error": repr(error), **extra}
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "role": watch.role,
        "pid": os.getpid(), **entry.as_dict(now),
        "action": "cancelled and counted" if entry.cancel is not None else "stopping the run",
        "in_flight": watch.in_flight(), "context": context, **extra,
        "stage_stack": task_stack(entry.task) if entry.task is not None else None,
        "stacks": {watch.role: own_stacks(), **_peer_stacks(watch)},
    }
    watch.stalls.append(report)
    path = watch.output_dir / watch.report_name
    with contextlib.suppress(OSError):
        watch.output_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(path)
    logger.error("%s\n  in flight: %d stage(s); context: %s\n  full report with stacks: %s",
                 message(watch, entry), len(report["in_flight"]),
                 json.dumps(context, default=str), path)
    return report


def message(watch: Any, entry: Any) -> str:
    """The one-line summary: who, which stage and detail, its deadline, what to do."""
    detail = ", ".join(f"{k}={v}" for k, v in entry.detail.items())
    setting = getattr(entry, "setting", None) or f"stall_timeouts[{entry.name!r}]"
    return (f"STALL in the {watch.role}: stage {entry.name!r}{f' ({detail})' if detail else ''} "
            f"passed its {entry.deadline_s:g} s deadline. Raise {setting} "
            f"if it is only slow; see {watch.output_dir / watch.report_name}.")


def _peer_stacks(watch: Any) -> dict[str, str]:
    """The stacks of the watch's peer process (the worker of the trainer, or the trainer's)."""
    if watch.peer_pid is None:
        return {}
    return stacks_of(watch.stack_path,
                     {"worker" if watch.role == "trainer" else "trainer": watch.peer_pid})


def stacks_of(stack_path: Callable[[str], Path], pids: dict[str, int]) -> dict[str, str]:
    """Ask processes (role: pid) to dump their stacks (faulthandler on SIGUSR2, each into
    its `stack_path(role)`), wait once, and read what each wrote."""
    stacks, offsets = {}, {}
    for role, pid in pids.items():
        path = stack_path(role)
        if not path.exists():  # no SIGUSR2 handler there: the signal would kill it
            stacks[role] = "(that process watches no stages: no stack dump)"
            continue
        offsets[role] = path.stat().st_size
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError as error:
            stacks[role] = f"(could not signal pid {pid}: {error})"
            del offsets[role]
    if offsets:
        time.sleep(PEER_DUMP_WAIT_S)
    for role, offset in offsets.items():
        try:
            with open(stack_path(role)) as file:
                file.seek(offset)
                stacks[role] = file.read() or "(it wrote no stacks)"
        except OSError as error:
            stacks[role] = f"(no stack dump: {error})"
    return stacks


def own_stacks() -> str:
    """Every thread's Python stack in this process, named."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def task_stack(task: asyncio.Task) -> str:
    """The await chain of a stuck task, outermost first (thread stacks show only the event
    loop, and `Task.get_stack` only the task's own frame)."""
    lines = [repr(task)]
    awaitable = task.get_coro()
    for _ in range(64):  # bounded: read from another thread, the chain may change under us
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is not None:
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, '
                         f"in {frame.f_code.co_name}")
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
        if awaitable is None:
            break
    return "\n".join(lines)
