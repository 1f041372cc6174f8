"""Per-token top-k sampler log-probs as two arrays instead of one Python dict per token.

Design decision: score centering needs the sampler's top-k log-probs of every trained token, so
each sample carries them from the rollout worker through the sample queue into the packed row.
As `list[dict[int, float]]` that is ~k Python objects per token to pickle in the worker, unpickle
in the trainer and walk again when packing (issue 21: most of the packing time of a step). Two
`[tokens, k]` arrays pickle as two buffers and pack by fancy indexing. Rows are left-aligned in
the server's rank order, padded with id -1 and log-prob -inf; a row of padding is a position
without top-k (context tokens, or an empty answer), read back as None.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

PAD_ID = -1


class TopLogprobs:
    """`ids[t, j]` / `logprobs[t, j]`: the j-th most likely token at position t and its log-prob."""

    __slots__ = ("ids", "logprobs")

    def __init__(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        if ids.shape != logprobs.shape or ids.ndim != 2:
            raise ValueError(
                f"TopLogprobs needs ids and logprobs of one [tokens, k] shape, got {ids.shape} "
                f"and {logprobs.shape}."
            )
        self.ids = ids.astype(np.int32, copy=False)
        self.logprobs = logprobs.astype(np.float64, copy=False)  # exactly what the server sent

    @classmethod
    def from_dicts(cls, rows: Sequence[dict[int, float] | None]) -> TopLogprobs:
        """From one `{token_id: log_prob}` (or None) per position, in the dicts' order."""
        width = max((len(row) for row in rows if row), default=0)
        ids = np.full((len(rows), width), PAD_ID, dtype=np.int32)
        logprobs = np.full((len(rows), width), -np.inf, dtype=np.float64)
        for t, row in enumerate(rows):
            if row:
                ids[t, : len(row)] = list(row.keys())
                logprobs[t, : len(row)] = list(row.values())
        return cls(ids, logprobs)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, t: int) -> dict[int, float] | None:
        keep = self.ids[t] != PAD_ID
        if not keep.any():
            return None
        return dict(zip(self.ids[t][keep].tolist(), self.logprobs[t][keep].tolist()))

    def __iter__(self) -> Iterator[dict[int, float] | None]:
        return (self[t] for t in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TopLogprobs):
            other = list(other)
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return list(self) == [row or None for row in other]

    def __repr__(self) -> str:
        return f"TopLogprobs(tokens={len(self)}, k={self.ids.shape[1]})"

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The `[len(positions), width]` ids and log-probs of those positions, width trimmed to
        their longest row (what a packed row of only these positions needs)."""
        ids, logprobs = self.ids[positions], self.logprobs[positions]
        width = int((ids != PAD_ID).sum(axis=1).max(initial=0))
        return ids[:, :width], logprobs[:, :width]


def as_top_logprobs(column: TopLogprobs | Sequence[dict[int, float] | None]) -> TopLogprobs:
    """Either form as arrays (a sequence built by hand may still hold dicts)."""
    return column if isinstance(column, TopLogprobs) else TopLogprobs.from_dicts(column)
