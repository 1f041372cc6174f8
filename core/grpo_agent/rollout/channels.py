"""`WorkerChannels`: everything the trainer and the spawned rollout worker share, by name.

Design decision: the worker is a spawned process, so what the two sides share must be
multiprocessing primitives created before the spawn and pickled into the child. Naming them
in one dataclass (instead of a dozen constructor arguments) says who writes what: the child
writes `samples`, `metrics`, `heartbeat`, `error` and `failed`; the trainer writes
`model_version`, `token_allowance`, `stop` and `server_restores`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METRICS_FLUSHED = "flushed"  # the worker's last message on the metrics queue: all is sent


@dataclass
class WorkerChannels:
    samples: Any  # Queue of TrainingSample | PromptConsumed, child -> trainer
    metrics: Any  # Queue of observation batches, child -> trainer
    error: Any  # Queue carrying the child's traceback, child -> trainer
    failed: Any  # Event: set once the traceback is on `error`
    model_version: Any  # Value('q'): the version the server holds, trainer -> child
    token_allowance: Any  # Value('d'): rollout.allowance.TokenAllowance.value(), trainer -> child
    heartbeat: Any  # Value('d'): the child's last beat (time.time()), child -> trainer
    stop: Any  # Event: the trainer asks the child to stop; it sends its last observations,
    # then METRICS_FLUSHED on `metrics` (after them: one FIFO writer)
    server_down: Any = None  # Event: the child lost the server and waits; the trainer clears
    # it once the server is back with its weights (`sampler.recovery`)
    server_restores: Any = None  # Value('q'): the server restores the trainer finished (whoever
    # noticed the loss), trainer -> child: the child re-reads the server's facts when it grows

    @classmethod
    def create(cls, context) -> WorkerChannels:
        """Fresh channels from a multiprocessing context (the trainer's "spawn" context)."""
        return cls(samples=context.Queue(), metrics=context.Queue(), error=context.Queue(),
                   failed=context.Event(), model_version=context.Value("q", 0),
                   token_allowance=context.Value("d", 0.0),
                   heartbeat=context.Value("d", 0.0), stop=context.Event(),
                   server_down=context.Event(),
                   server_restores=context.Value("q", 0))

    @property
    def queues(self) -> tuple:
        return (self.samples, self.metrics, self.error)
