"""Keeping Python's cyclic garbage collector off the trainer's step.

Design decision: planning a step builds one prefix-trie node per forwarded token (about 50k
objects for a 16k-token row), which live for the tens of milliseconds of planning. That many
allocations run the collector's young generations dozens of times per step, the nodes survive
them and are promoted, and every few steps the promotions trigger a full collection, which
walks every object of the process: 0.25-0.3 s on a 2-core CPU box with a tiny model (more
with compiled graphs and a real model's modules), one step in three to five. The nodes hold
no cycles (children lists, no parent links), so reference counting frees them when the plan
is made; the collector has nothing to find there. So:

- `cyclic_gc_paused` turns the collector off while a step is pulled and planned (the whole
  pull: a collection run between two samples would promote the nodes as before; cyclic
  garbage other threads make meanwhile waits for the next collection after it);
- `freeze_long_lived` moves what exists at train begin and after the first step (modules,
  compiled graphs, the pipeline) to the permanent generation (`gc.freeze`), so a collection
  that does run walks only what the run made since; `thaw` gives them back to the collector
  when training returns (what became garbage meanwhile is collected then, not leaked).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic collector off inside (reference counting still frees everything acyclic);
    back to its previous state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_long_lived() -> None:
    """Every object alive now out of later collections (no collection first: garbage frozen
    with them is collected after `thaw`)."""
    gc.freeze()


def thaw() -> None:
    """Frozen objects back under the collector (`gc.unfreeze`)."""
    gc.unfreeze()
