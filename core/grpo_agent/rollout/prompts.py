"""The worker's prompt stream: epochs, per-epoch shuffling, filtering and resume.

Design decision: every prompt gets a *prompt index*, its position in the stream
(`epoch * len(dataset) + position in that epoch's shuffled order`). The order of each epoch is
a pure function of `(seed, epoch)`, so resuming at a prompt index replays exactly the same
order without storing it. Filtered prompts still consume their index (the spec counts them
as consumed), and an epoch in which the filter rejects everything raises, because no batch
could ever reach the trainer. An `IterableDataset` cannot be repositioned: it streams in its
own order and restarts from its first prompt on resume. Without a dataset (an environment
owns the data) the stream yields empty rows until the worker is stopped.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

PromptFilter = Callable[[int, dict[str, Any], int], bool]


@dataclass
class PromptSlot:
    """One prompt handed to the dispatcher, with its place in the stream."""

    prompt_index: int
    row_index: int
    epoch: int
    row: dict[str, Any]
    accepted: bool = True  # False: filter_prompt rejected it; it is consumed without rollouts


class AllPromptsFilteredError(RuntimeError):
    """`filter_prompt` rejected every prompt of an epoch: training can never get a batch."""


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a shuffle seeded by `(seed, epoch)`."""
    order = list(range(num_rows))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def iterate_prompts(
    dataset: Any, *, seed: int, start_index: int, accept: PromptFilter
) -> Iterator[PromptSlot]:
    """Yield every prompt of the stream, rejected ones with `accepted=False`.

    The caller reports rejected prompts as consumed. The stream is endless: epochs follow each
    other until the caller stops pulling (the trainer decides when training is over).
    """
    if dataset is None:
        yield from _environment_rows(start_index)
    elif hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        yield from _indexed_rows(dataset, seed=seed, start_index=start_index, accept=accept)
    else:
        yield from _streamed_rows(dataset, accept=accept)


def _environment_rows(start_index: int) -> Iterator[PromptSlot]:
    for index in itertools.count(start_index):
        yield PromptSlot(prompt_index=index, row_index=index, epoch=0, row={})


def _indexed_rows(
    dataset: Any, *, seed: int, start_index: int, accept: PromptFilter
) -> Iterator[PromptSlot]:
    num_rows = len(dataset)
    if num_rows == 0:
        raise ValueError("The training dataset is empty: give it at least one prompt row.")
    epoch, position = divmod(start_index, num_rows)
    while True:
        order = epoch_order(num_rows, seed, epoch)
        accepted_any = position > 0  # a resumed epoch already trained earlier prompts
        for offset in range(position, num_rows):
            row_index = order[offset]
            row = dict(dataset[row_index])
            prompt_index = epoch * num_rows + offset
            accepted = bool(accept(row_index, row, epoch))
            accepted_any = accepted_any or accepted
            yield PromptSlot(prompt_index, row_index, epoch, row, accepted)
        if not accepted_any:
            raise AllPromptsFilteredError(
                f"filter_prompt rejected all {num_rows} prompts of epoch {epoch}, so no batch "
                "can reach the trainer. Loosen the filter (or its thresholds) or stop training."
            )
        epoch, position = epoch + 1, 0


def _streamed_rows(dataset: Any, *, accept: PromptFilter) -> Iterator[PromptSlot]:
    prompt_index = 0
    for epoch in itertools.count():
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        accepted_any = False
        seen_any = False
        for row_index, row in enumerate(dataset):
            seen_any = True
            row = dict(row)
            accepted = bool(accept(row_index, row, epoch))
            accepted_any = accepted_any or accepted
            yield PromptSlot(prompt_index, row_index, epoch, row, accepted)
            prompt_index += 1
        if not seen_any:
            raise ValueError("The streamed training dataset yielded no rows.")
        if not accepted_any:
            raise AllPromptsFilteredError(
                f"filter_prompt rejected every prompt of streamed epoch {epoch}, so no batch can "
                "reach the trainer. Loosen the filter or stop training."
            )
