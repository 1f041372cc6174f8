"""Disjoint CPU cores for a local vLLM CPU server and the trainer beside it.

Design decision: vLLM's CPU backend binds its OpenMP compute threads to fixed cores, and
torch in the trainer starts one thread per core, so on a shared machine both oversubscribe
the same cores (on the 2-core development box a synchronous step took 1.5x longer shared,
docs/performance.md). Splitting the cores is the CPU analogue of giving vLLM and the trainer
their own GPUs: the server's compute threads get the first half of this process's cores
(`VLLM_CPU_OMP_THREADS_BIND`), the trainer and its rollout worker the rest. Only for servers
this process starts on a machine without CUDA; a server elsewhere is left alone.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


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
