"""Small tensor functions compiled on CUDA, run eagerly elsewhere or where compiling fails.

Why: element-wise work written as several torch ops costs one kernel and one memory pass
each; `torch.compile` fuses such a function into one or two kernels. The functions wrapped
here are pure (no autograd of their own, no mutation), so compiling them is safe inside
custom ops and CUDA graph captures (the first call, which compiles, comes before capture).
On CPU compiling would only slow the tests down; a failed compile (no Triton, an old GPU, a
compiler bug) warns once and runs eagerly: the eager function is the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

COMPILE_ON_CUDA = True  # set False to run the wrapped functions eagerly on CUDA too


class CompiledOrEager:
    """Call `fn` compiled on `devices`; fall back to eager (once, with a warning) if compiling
    fails. Anywhere else, or with COMPILE_ON_CUDA off, `fn` runs eagerly."""

    def __init__(self, fn: Callable, devices: tuple[str, ...] = ("cuda",)):
        self.fn, self.devices = fn, devices
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, first: torch.Tensor, *args):
        if first.device.type not in self.devices or self.failed or not COMPILE_ON_CUDA:
            return self.fn(first, *args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=True)
            return self.compiled(first, *args)
        except Exception as exc:  # noqa: BLE001 -- no Triton, old GPU, compiler bug: eager is right
            log.warning(
                "torch.compile of %s failed (%s); running it eagerly", self.fn.__name__,
                str(exc),  # text: see varlen_attention.load_hub_kernel
            )
            self.failed = True
            return self.fn(first, *args)
