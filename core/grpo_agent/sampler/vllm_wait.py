"""Inside a CPU vLLM server: its shared-memory queues wait by sleeping briefly, not spinning.

Design decision: vLLM's engine core and its worker pass every step through shared-memory
queues whose readers (and a writer waiting for a free slot) spin on `os.sched_yield` for a
second after each message. On a GPU host those cores are spare. On a CPU box the worker sits
on the core vLLM binds its compute to and spins there whenever it waits for the scheduler,
so the kernel crowds the API server, the engine core (spinning too, while the worker
computes) and the trainer onto the other cores. On the 2-core box (issue 21, docs/performance.md)
the engine then ran 300-450 steps/s of 2-6 tokens each with 32 requests in flight, the API
server too starved of CPU to feed it: 515-4,900 generated tokens/s from round to round. With a
100 us sleep in place of the yield: 4,100-5,000 tokens/s in every round, the worker at 0.6 of
a core instead of 1.0, and issue 21's pipeline 3,950 trained tokens/s against 2,064-2,513.
Waiting on vLLM's own idle path instead (its zmq notification, busy window 0) ran the engine at
about 10 steps/s: the notifications do not wake a reader promptly under load.

`ManagedVLLMServer` sets `WAIT_SLEEP_ENV` for servers on machines without CUDA; vLLM loads
this through the general plugin (`vllm_plugin.register`) in each of its processes. Unset or
"0" leaves vLLM as it is (GPU servers, or a user who prefers the spin).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping

logger = logging.getLogger("vllm.grpo_agent")  # inside vLLM: its handler prints it

WAIT_SLEEP_ENV = "GRPO_AGENT_VLLM_WAIT_SLEEP_S"
CPU_WAIT_SLEEP_S = 1e-4  # one poll costs a few us: about 5% of a core while a queue waits


def sleep_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """The sleep `WAIT_SLEEP_ENV` asks for (0: vLLM's spin); a bad value raises, naming it."""
    text = environ.get(WAIT_SLEEP_ENV, "").strip()
    if not text:
        return 0.0
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < 1:
        raise ValueError(f"{WAIT_SLEEP_ENV}={text!r}: give seconds in [0, 1) (e.g. "
                         f"{CPU_WAIT_SLEEP_S}), or 0 / unset to keep vLLM's spinning wait.")
    return seconds


def install(environ: Mapping[str, str] = os.environ) -> bool:
    """Replace the yield in vLLM's shared-memory queues with a `sleep_seconds()` sleep.
    Returns whether it did; a vLLM without that yield is left alone, with a warning."""
    seconds = sleep_seconds(environ)
    if seconds == 0:
        return False
    from vllm.distributed.device_communicators import shm_broadcast

    if not callable(getattr(shm_broadcast, "sched_yield", None)):
        logger.warning("%s is set but this vLLM's shm_broadcast has no sched_yield to replace; "
                       "its queues keep spinning.", WAIT_SLEEP_ENV)
        return False
    shm_broadcast.sched_yield = functools.partial(time.sleep, seconds)
    logger.info("grpo-agent: vLLM's shared-memory queues sleep %g s per wait (pid %d, %s).",
                seconds, os.getpid(), WAIT_SLEEP_ENV)
    return True
