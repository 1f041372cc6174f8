"""Disjoint CPU cores for a local vLLM CPU server and the trainer beside it.

Design decision: vLLM's CPU backend binds its OpenMP compute threads to fixed cores, and
torch in the trainer starts one thread per core, so on a shared machine both oversubscribe
the same cores (on the 2-core development box a synchronous step took 1.5x longer shared,
docs/performance.md). Splitting the cores is the CPU analogue of giving vLLM and the trainer
their own GPUs: the server's compute threads get the first half of this process's cores
(`VLLM_CPU_OMP_THREADS_BIND`), the trainer and its rollout worker the rest. Only for servers
this process starts on a machine without CUDA; a server elsewhere is left alone.

Design decision: such a server also runs at a lower CPU priority than the trainer
(`SERVER_NICE`). Its API process and the engine's scheduler threads are not bound and share the
trainer's cores; Linux's autogroups give the server's session (it is started in its own) an
equal share against the trainer's, whatever the threads' nice values, so the trainer got about
half of its core: its forward+backward took 2.6-3.6x its time alone. With the session's
autogroup at nice 5 or 10 it took 1.0-1.07x, and trained tokens/s rose 2,000 -> 2,350-2,530 on
issue 21's task (docs/performance.md). Without autogroups the threads' nice values decide, so
both are set.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
SERVER_NICE = 5  # the server's priority beside the trainer (0 is the default, 19 the lowest)


@dataclass(frozen=True)
class CoreSplit:
    server: list[int]
    trainer: list[int]

    def server_env(self) -> dict[str, str]:
        """Environment for the server process: its OpenMP threads on its cores."""
        return {OMP_BIND_ENV: ",".join(map(str, self.server))}


def split_cores(cores: set[int] | None = None) -> CoreSplit | None:
    """Halves of this process's CPU affinity; None with fewer than 2 cores (nothing to split)."""
    ordered = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(ordered) < 2:
        return None
    half = len(ordered) // 2
    return CoreSplit(server=ordered[:half], trainer=ordered[half:])


@contextlib.contextmanager
def trainer_on(cores: list[int]) -> Iterator[None]:
    """Run this process (and the children it starts meanwhile) on `cores` with as many torch
    threads; the previous affinity and thread count come back afterwards."""
    import torch

    previous_cores, previous_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous_cores)
        torch.set_num_threads(previous_threads)


def lower_priority(session_pid: int, nice: int) -> None:
    """Run the process group and session led by `session_pid` (a process started with
    `start_new_session=True`) at nice value `nice`, including the processes and threads it
    starts later. Raising one's own processes' nice needs no privilege; where a kernel refuses
    (no autogroups, not Linux), what it refuses is skipped."""
    try:  # the session's autogroup: what decides its share against the trainer's session
        with open(f"/proc/{session_pid}/autogroup", "w") as autogroup:
            autogroup.write(f"{nice}\n")
    except OSError:
        pass
    try:  # every thread of the group now; later ones inherit their creator's value
        os.setpriority(os.PRIO_PGRP, session_pid, nice)
    except (OSError, AttributeError):
        pass
