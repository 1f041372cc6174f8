"""The prompt stream: seeded per-epoch order, resume by prompt index, filtering, streaming."""
from __future__ import annotations

import itertools

import pytest
from datasets import Dataset, IterableDataset
from grpo_agent.rollout.prompts import AllPromptsFilteredError, epoch_order, iterate_prompts


def _dataset(n: int) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": str(i)}], "i": i} for i in range(n)])


def _accept_all(row_index, row, epoch):
    return True


def test_each_epoch_is_a_seeded_shuffle_that_covers_every_row_once():
    stream = iterate_prompts(_dataset(10), seed=3, start_index=0, accept=_accept_all)
    slots = list(itertools.islice(stream, 20))
    first, second = [s.row_index for s in slots[:10]], [s.row_index for s in slots[10:]]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second, "epochs must be reshuffled"
    assert first == epoch_order(10, 3, 0) and second == epoch_order(10, 3, 1)
    assert [s.prompt_index for s in slots] == list(range(20))
    assert [s.epoch for s in slots] == [0] * 10 + [1] * 10
    assert all(s.row["i"] == s.row_index for s in slots)


def test_resuming_at_a_prompt_index_replays_the_same_order():
    full = list(itertools.islice(iterate_prompts(_dataset(7), seed=1, start_index=0, accept=_accept_all), 16))
    resumed = list(itertools.islice(iterate_prompts(_dataset(7), seed=1, start_index=9, accept=_accept_all), 7))
    assert [(s.prompt_index, s.row_index) for s in resumed] == [(s.prompt_index, s.row_index) for s in full[9:]]


def test_rejected_prompts_are_yielded_as_consumed_and_a_fully_rejected_epoch_raises():
    def odd_rows_first_epoch_only(row_index, row, epoch):
        return epoch == 0 and row_index % 2 == 1

    stream = iterate_prompts(_dataset(6), seed=0, start_index=0, accept=odd_rows_first_epoch_only)
    first_epoch = list(itertools.islice(stream, 6))
    assert sorted(s.row_index for s in first_epoch if s.accepted) == [1, 3, 5]
    assert len([s for s in first_epoch if not s.accepted]) == 3
    with pytest.raises(AllPromptsFilteredError, match="rejected all 6 prompts of epoch 1"):
        list(itertools.islice(stream, 7))  # the raise comes after the epoch's last prompt


def test_an_iterable_dataset_streams_in_its_own_order_epoch_after_epoch():
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(4)]
    dataset = IterableDataset.from_generator(lambda: iter(rows))
    slots = list(itertools.islice(iterate_prompts(dataset, seed=0, start_index=0, accept=_accept_all), 8))
    assert [s.row_index for s in slots] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [s.prompt_index for s in slots] == list(range(8))


def test_a_streamed_epoch_whose_every_prompt_is_rejected_raises_after_its_last_prompt():
    """The stream is endless: without the raise a filter that rejects everything (a curriculum
    whose every prompt reached its cap) would keep the worker reading epochs with nothing to
    roll out, the trainer waiting on an empty queue."""
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(3)]
    dataset = IterableDataset.from_generator(lambda: iter(rows))
    stream = iterate_prompts(dataset, seed=0, start_index=0, accept=lambda i, row, epoch: epoch == 0)
    slots = list(itertools.islice(stream, 6))
    assert [(s.epoch, s.accepted) for s in slots] == [(0, True)] * 3 + [(1, False)] * 3
    with pytest.raises(AllPromptsFilteredError, match="rejected every prompt of streamed epoch 1"):
        next(stream)


def test_without_a_dataset_the_environment_gets_empty_rows_from_the_start_index():
    slots = list(itertools.islice(iterate_prompts(None, seed=0, start_index=5, accept=_accept_all), 3))
    assert [(s.prompt_index, s.row) for s in slots] == [(5, {}), (6, {}), (7, {})]


def test_an_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="empty"):
        next(iterate_prompts(_dataset(0), seed=0, start_index=0, accept=_accept_all))


def test_a_resumed_epoch_whose_remaining_prompts_are_all_rejected_does_not_raise():
    """Resuming mid-epoch, the prompts before the resume point were accepted earlier; only a
    whole epoch of rejections raises (here the next one)."""
    def reject_all(row_index, row, epoch):
        return False

    stream = iterate_prompts(_dataset(3), seed=0, start_index=2, accept=reject_all)
    slots = list(itertools.islice(stream, 4))  # the resumed epoch's last prompt, then epoch 1
    assert [(s.prompt_index, s.accepted) for s in slots] == [(2, False), (3, False), (4, False), (5, False)]
    with pytest.raises(AllPromptsFilteredError, match="epoch 1"):
        next(stream)


class _Streamed:
    """An iterable dataset with `set_epoch`, like `datasets.IterableDataset`."""

    def __init__(self, rows):
        self.rows, self.epochs = rows, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter([{"i": (row, self.epochs[-1])} for row in self.rows])


def test_a_streamed_dataset_is_told_each_epoch_before_it_streams():
    """`set_epoch` reshuffles a streamed dataset (its shuffle buffer seeds from the epoch)."""
    dataset = _Streamed([0, 1])
    slots = list(itertools.islice(iterate_prompts(dataset, seed=0, start_index=0, accept=_accept_all), 4))
    assert dataset.epochs == [0, 1]
    assert [s.row["i"] for s in slots] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_a_streamed_dataset_without_rows_says_so_and_blames_no_filter():
    with pytest.raises(ValueError, match="streamed training dataset yielded no rows"):
        next(iterate_prompts(iter(()), seed=0, start_index=0, accept=_accept_all))


class _StreamedOwnRows:
    """A streamed dataset that hands out the same row dicts every epoch (a generator over a list)."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


@pytest.mark.parametrize("streamed", [False, True], ids=["indexed", "streamed"])
def test_what_a_filter_writes_into_its_row_stays_out_of_the_dataset_and_later_epochs(streamed):
    """Each prompt comes in a dict of its own: a list of dicts is a dataset too, and a filter (or
    a hook after it) that writes into the row it is shown must not change the user's rows or the
    row of the next epoch."""
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
    dataset = _StreamedOwnRows(rows) if streamed else rows

    def tag_row(row_index, row, epoch):
        row.setdefault("tagged_in_epochs", []).append(epoch)
        return True

    slots = list(itertools.islice(iterate_prompts(dataset, seed=0, start_index=0, accept=tag_row), 2))
    assert [s.row["tagged_in_epochs"] for s in slots] == [[0], [1]]
    assert rows == [{"prompt": [{"role": "user", "content": "hi"}]}]
