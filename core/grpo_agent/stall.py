"""Stage deadlines and the stall report: no stage of a run waits silently forever.

Why: the commonest failure of async RL is the silent hang (GPUs idle, no error). Each process
(trainer, rollout worker) holds one `StallWatch`. Code brackets a stage with
`watch.stage(name, detail)`; a monitor thread checks once a second for a stage past its
deadline (`stage_deadline`: the config's `stall_timeouts`, else derived from the config). The
first time one is late it writes `stall_report.json` to the output dir (the stage, its detail,
how long, every stage in flight, the process's context such as queue sizes and versions, and the
Python stacks of this process and of its peer, the latter dumped by `faulthandler` on SIGUSR2),
logs a summary (`stall_report.py` writes both), then acts: a stage with a `cancel` callback is cancelled (the rollout is dropped
and counted; the code that owns the stage sees `StageStalled`); a stage without one is fatal:
the abort callbacks run and the process exits with `STALL_EXIT_CODE` after `ABORT_GRACE_S`
(a polled stage, such as the trainer's queue pull, raises `StageStalled` itself sooner; a
stage nothing can unblock, such as a collective, exits right after its report).

Under FSDP every trainer process holds a watch (`collective` stages, `train/collectives.py`);
rank r > 0 writes `stall_report-rank<r>.json`.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import faulthandler
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_agent import stall_report
from grpo_agent.stall_report import STACK_SIGNAL

logger = logging.getLogger(__name__)

STALL_EXIT_CODE = 3
CHECK_INTERVAL_S = 1.0
ABORT_GRACE_S = 30.0
REPORT_NAME = "stall_report.json"
# Margin over the timeout a stage enforces itself, so its own clear error comes first.
OWN_TIMEOUT_MARGIN_S = 60.0
STAGES = ("vllm_generate", "tool", "env_reset", "env_finish", "scoring", "queue_pull",
          "weight_sync", "weight_sync/pause", "weight_sync/transfer", "weight_sync/finish",
          "weight_sync/resume", "weight_sync/cache_reset", "checkpoint_save", "server_restore",
          "collective")
# What a managed vLLM server's (re)start may take (`ManagedVLLMServer.startup_timeout`): a
# restore bounded by it must not be cut short by its stage deadline.
SERVER_STARTUP_TIMEOUT_S = 600.0
# The trainer's collectives under FSDP: a phase's deadline is the collective deadline plus the
# stage rank 0 may legitimately spend in it while the other ranks wait (None: nothing).
COLLECTIVE_DEADLINE_S = 1800.0  # torch's own default process-group timeout
COLLECTIVE_PHASES = {"step plan": "queue_pull", "train step": None, "step end": None,
                     "weight push": "weight_sync", "server restore": "server_restore",
                     "checkpoint save": "checkpoint_save"}
# The process group's own timeout is this much past the longest phase deadline, so the stall
# report and exit come first (NCCL's watchdog would kill the process without one).
PROCESS_GROUP_MARGIN_S = 60.0


_ACTIVE: StallWatch | None = None  # the started watch of this process, for `stage`
_ABORT_CALLBACKS: list[Callable[[], None]] = []
_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("stall_group", default=None)


def set_group(key: Any) -> None:
    """Stages opened from now on in this task, and in the tasks it creates, belong to group
    `key` (the worker's rollout group): the rollouts of a group pass their deadlines together,
    and one cancel drops them all, so the watch reports the group once."""
    _GROUP.set(key)


def stage(name: str, deadline_s: float | None = None, **detail: Any) -> contextlib.AbstractContextManager:
    """`StallWatch.stage` on this process's started watch (a fatal stage); a no-op without one,
    so shared code (weight sync, checkpoints) can mark its stages without holding a watch."""
    if _ACTIVE is None:
        return contextlib.nullcontext()
    return _ACTIVE.stage(name, deadline_s, **detail)


def active() -> StallWatch | None:
    """This process's started watch, if any."""
    return _ACTIVE


def raise_if_stalled(entry: _Stage | None) -> None:
    """For a stage its owner polls (from `stage`): raise once the monitor reported it."""
    if _ACTIVE is not None:
        _ACTIVE.raise_if_stalled(entry)


def on_abort(callback: Callable[[], None]) -> None:
    """Run `callback` (e.g. stop the managed server or the worker) before a fatal stall exit."""
    _ABORT_CALLBACKS.append(callback)


def remove_abort(callback: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _ABORT_CALLBACKS.remove(callback)


class StageStalled(RuntimeError):
    """A stage passed its deadline; `stall_report.json` in the output dir tells which."""


def stage_deadline(config: Any, stage: str) -> float:
    """Seconds `stage` may take: `config.stall_timeouts[stage]` (or its family's, e.g.
    `weight_sync` for `weight_sync/transfer`), else derived from the timeouts the stage uses."""
    explicit = dict(getattr(config, "stall_timeouts", None) or {})
    for key in (stage, stage.split("/")[0]):
        if key in explicit:
            return float(explicit[key])
    server = float(getattr(config, "vllm_server_timeout", 1800.0))
    worker = float(getattr(config, "rollout_worker_timeout", 300.0))
    tool = float(getattr(config, "tool_timeout_s", 300.0))
    family = stage.split("/")[0]
    derived = {
        "vllm_generate": server + OWN_TIMEOUT_MARGIN_S,  # the client's own timeout fires first
        "tool": tool + OWN_TIMEOUT_MARGIN_S,
        "env_reset": tool, "env_finish": tool,
        "scoring": worker,
        "queue_pull": server + worker,  # one generation may take up to vllm_server_timeout
        "weight_sync": server + OWN_TIMEOUT_MARGIN_S,
        "checkpoint_save": server,
        # A managed server's restart (its startup_timeout) or an external one's return
        # (vllm_server_timeout), whose own errors come first.
        "server_restore": max(server, SERVER_STARTUP_TIMEOUT_S) + OWN_TIMEOUT_MARGIN_S,
        "collective": COLLECTIVE_DEADLINE_S,
    }
    if family not in derived:
        raise KeyError(f"Unknown stall stage {stage!r}; known stages: {', '.join(STAGES)}.")
    return derived[family]


def collective_deadline(config: Any, phase: str) -> float:
    """Seconds one rank may wait for the others in `phase` (`COLLECTIVE_PHASES`)."""
    waits_for = COLLECTIVE_PHASES[phase]
    own = stage_deadline(config, waits_for) if waits_for else 0.0
    return stage_deadline(config, "collective") + own


def process_group_timeout(config: Any) -> float:
    """The distributed process group's timeout (`ddp_timeout`): past every phase deadline."""
    return max(collective_deadline(config, p) for p in COLLECTIVE_PHASES) + PROCESS_GROUP_MARGIN_S


def check_stall_timeouts(timeouts: dict[str, float]) -> None:
    """Refuse a misspelt stage or a non-positive deadline at config time."""
    for stage, seconds in timeouts.items():
        if stage not in STAGES:
            raise ValueError(f"stall_timeouts has unknown stage {stage!r}; use one of: {', '.join(STAGES)}.")
        try:
            positive = float(seconds) > 0
        except (TypeError, ValueError):  # float's own error names neither the field nor the fix
            positive = False
        if not positive or isinstance(seconds, bool):
            raise ValueError(f"stall_timeouts[{stage!r}]={seconds!r}: a deadline must be a "
                             "number of seconds > 0.")


@dataclass
class _Stage:
    name: str
    detail: dict[str, Any]
    deadline_s: float
    started: float = field(default_factory=time.monotonic)
    thread_id: int = field(default_factory=threading.get_ident)
    cancel: Callable[[], None] | None = None
    task: asyncio.Task | None = None  # a recoverable stage's task: its stack is the stuck one
    stalled_at: float | None = None  # set once its report is written (owners poll this)
    reported: bool = False
    grace_s: float = ABORT_GRACE_S  # a fatal stage's owner has this long to raise, then exit
    report_extra: Callable[[], dict[str, Any]] | None = None  # fields computed at report time
    setting: str | None = None  # what raises its deadline, where not stall_timeouts[name]
    group: Any = field(default_factory=_GROUP.get)  # `set_group`'s key where one was set

    def touch(self) -> None:
        """Progress was made: the deadline counts from now (a poll that received something)."""
        self.started = time.monotonic()

    def age(self, now: float) -> float:
        return now - self.started

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """A stage with a deadline of its own runs inside this one (a server restore inside
        the queue pull): this one's clock stops meanwhile and restarts after it."""
        deadline, self.deadline_s = self.deadline_s, float("inf")
        try:
            yield
        finally:
            self.deadline_s = deadline
            self.touch()

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"stage": self.name, **self.detail, "elapsed_s": round(self.age(now), 3),
                "deadline_s": self.deadline_s, "stalled": self.reported}


def watch_folder(config: Any, output_dir: str | os.PathLike | None = None) -> Path:
    """Where a watch writes its stack file and report: the run's output_dir, else here."""
    return Path(output_dir or getattr(config, "output_dir", None) or ".")


def stack_file(folder: Path, role: str) -> Path:
    """The faulthandler file a watch of `role` keeps open (its presence lets a peer signal it)."""
    return folder / f"stacks-{role}.txt"


class StallWatch:
    """The registry of in-flight stages of one process, its monitor thread and report writer."""

    def __init__(self, config: Any, role: str, *, output_dir: str | os.PathLike | None = None,
                 context: Callable[[], dict[str, Any]] | None = None,
                 report_name: str = REPORT_NAME) -> None:
        self.config = config
        self.role = role
        self.report_name = report_name
        self.output_dir = watch_folder(config, output_dir)
        self.context = context or dict
        self.peer_pid: int | None = None
        self.stalls: list[dict[str, Any]] = []
        self._cancelled_groups: set[Any] = set()  # groups reported and cancelled (`set_group`)
        self._stages: dict[int, _Stage] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stack_file = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> StallWatch:
        """Start the monitor and let a peer ask for this process's stacks (SIGUSR2)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if threading.current_thread() is threading.main_thread():
            self._stack_file = open(self.stack_path(self.role), "w")  # noqa: SIM115 - faulthandler keeps it
            faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        self._thread = threading.Thread(target=self._monitor, name=f"stall-watch-{self.role}", daemon=True)
        self._thread.start()
        global _ACTIVE
        _ACTIVE = self
        return self

    def stop(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self._stop.set()
        if self._stack_file is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._stack_file.close()
            self._stack_file = None
            with contextlib.suppress(OSError):  # its absence tells a peer not to signal us
                self.stack_path(self.role).unlink()

    def stack_path(self, role: str) -> Path:
        return stack_file(self.output_dir, role)

    # ------------------------------------------------------------------ stages

    @contextlib.contextmanager
    def stage(self, name: str, deadline_s: float | None = None, *, recover: bool = False,
              grace_s: float | None = None,
              report_extra: Callable[[], dict[str, Any]] | None = None,
              **detail: Any) -> Iterator[_Stage]:
        """Bracket one stage. With `recover` (asyncio code only) the stage is recoverable: at its
        deadline its task is cancelled and the block raises `StageStalled`, for the owner to
        drop and count; without it a late stage is fatal (see the module docstring): the
        process exits `grace_s` (default `ABORT_GRACE_S`, read now, so a change to the module's
        value applies) after the report unless the owner raised meanwhile.
        `report_extra` adds fields to its report, computed when it is written."""
        deadline = stage_deadline(self.config, name) if deadline_s is None else float(deadline_s)
        key = next(self._ids)
        grace_s = ABORT_GRACE_S if grace_s is None else grace_s
        entry = _Stage(name, detail, deadline, grace_s=grace_s, report_extra=report_extra)
        if recover:
            task, loop = asyncio.current_task(), asyncio.get_running_loop()
            entry.cancel = lambda: loop.call_soon_threadsafe(self._cancel_task, key, task)
            entry.task = task
        with self._lock:
            self._stages[key] = entry
        try:
            yield entry
        except asyncio.CancelledError:
            if entry.stalled_at is None or not recover:
                raise
            asyncio.current_task().uncancel()  # our cancel, not a shutdown: the owner goes on
            raise StageStalled(self._message(entry)) from None
        finally:
            with self._lock:
                self._stages.pop(key, None)

    def _cancel_task(self, key: int, task: asyncio.Task) -> None:
        with self._lock:
            still_running = key in self._stages
        if still_running:  # a stage that ended meanwhile must not cancel what its task does next
            task.cancel()

    def raise_if_stalled(self, entry: _Stage | None) -> None:
        """For a stage its owner polls: raise as soon as the monitor reported it."""
        if entry is not None and entry.stalled_at is not None:
            raise StageStalled(self._message(entry))

    def in_flight(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            return [s.as_dict(now) for s in self._stages.values()]

    # ------------------------------------------------------------------ monitor

    def _monitor(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            self.check()

    def check(self) -> list[_Stage]:
        """Report and act on every stage newly past its deadline; returns those."""
        now = time.monotonic()
        with self._lock:
            late = [s for s in self._stages.values() if not s.reported and s.age(now) > s.deadline_s]
            for entry in late:
                entry.reported = True
        for entry in late:
            with self._lock:
                if entry not in self._stages.values():
                    continue  # gone meanwhile: a sibling's cancel dropped its whole group
            if entry.cancel is not None and entry.group in self._cancelled_groups:
                continue  # a sibling's report and cancel, sent but not run yet, drop it too
            self.report(entry)
            entry.stalled_at = now  # only now: an owner that polls must find the report written
            if entry.cancel is not None:
                if entry.group is not None:
                    self._cancelled_groups.add(entry.group)
                entry.cancel()
            else:
                threading.Thread(target=self._abort_if_still_stuck, args=(entry,), daemon=True).start()
        return late

    def _abort_if_still_stuck(self, entry: _Stage) -> None:
        deadline = time.monotonic() + entry.grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if entry not in self._stages.values():
                    return  # its owner raised StageStalled and is shutting down
            time.sleep(0.2)
        logger.critical("Stage %s is still stuck %.0f s after its stall report: exiting with code %d.",
                        entry.name, entry.grace_s, STALL_EXIT_CODE)
        for callback in _ABORT_CALLBACKS:
            with contextlib.suppress(Exception):
                callback()
        logging.shutdown()
        os._exit(STALL_EXIT_CODE)

    # ------------------------------------------------------------------ report

    def report(self, entry: _Stage, **extra: Any) -> dict[str, Any]:
        """Write `stall_report.json` for `entry` and log a readable summary (`stall_report`)."""
        return stall_report.write(self, entry, extra)

    def report_stall(self, name: str, detail: dict[str, Any], deadline_s: float, started: float,
                     *, setting: str | None = None, **extra: Any) -> None:
        """Report a stall found outside this watch's stages (the trainer's no-progress guard,
        a failed collective); `setting` names the config field that raises its deadline where
        that is no `stall_timeouts` key."""
        entry = _Stage(name, detail, deadline_s, started=started, setting=setting)
        entry.stalled_at, entry.reported = time.monotonic(), True
        self.report(entry, **extra)

    def _message(self, entry: _Stage) -> str:
        return stall_report.message(self, entry)

    def stacks_of(self, pids: dict[str, int]) -> dict[str, str]:
        """Ask processes (role: pid) for their stacks (`stall_report.stacks_of`)."""
        return stall_report.stacks_of(self.stack_path, pids)
