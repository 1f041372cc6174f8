"""Device time of each row's forward and forward+backward, read once per optimizer step.

Design decision: the rows of a step run back to back without the host waiting for the GPU
(`transfer`), so a host clock around a row only says how long queueing it took. On CUDA the
marks are events recorded on the stream, read after the step's last backward has finished;
elsewhere the work is synchronous and the host clock is the device's.
"""

from __future__ import annotations

import time

import torch


class RowClock:
    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._rows: list[list] = []  # per row: [start, forward queued, backward queued]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_row(self) -> None:
        self._rows.append([self._mark()])

    def forward_done(self) -> None:
        self._rows[-1].append(self._mark())

    def forward_unseen(self) -> None:
        """This row's forward and backward ran as one (a CUDA graph replay): no forward time."""
        self._rows[-1].append(None)

    def end_row(self) -> None:
        self._rows[-1].append(self._mark())

    def read(self) -> dict[str, float | None]:
        """Seconds of forward ("fwd") and forward+backward ("fwd_bwd") summed over the rows
        since the last read (waits for the last one to finish); "fwd" is over the rows whose
        forward was seen, None if none was."""
        rows, self._rows = [r for r in self._rows if len(r) == 3], []
        if self.cuda and rows:
            rows[-1][-1].synchronize()
        seen = [(start, forward) for start, forward, _ in rows if forward is not None]
        fwd = sum(self._seconds(start, forward) for start, forward in seen)
        fwd_bwd = sum(self._seconds(start, end) for start, _, end in rows)
        return {"fwd": fwd if seen or not rows else None, "fwd_bwd": fwd_bwd}

    def _seconds(self, start, stop) -> float:
        return start.elapsed_time(stop) / 1000 if self.cuda else stop - start
