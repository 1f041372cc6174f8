"""Window aggregation of metrics, following the spec's rules.

Everything observed since the last log (the last `logging_steps` optimizer steps) is reduced
once per window, by the words (split at ``_``) of the last part of the metric name, so
``completions/mean_terminated_length`` is a mean although "terminated" holds "min":

- a rate (the last part ends in ``_per_s``, e.g. ``rollout/generated_tokens_per_s``; recorded
  with `add_rate`): total amount over total seconds;
- has the word ``count``: summed (``sample/dropped_stale_count`` = drops since the last log);
- has the word ``max`` / ``min``: the extreme is kept (``completions/max_length``);
- anything else: the mean of the observations in the window.

Observations cross the process boundary (rollout worker -> trainer) as plain tuples, so the
worker needs nothing but this module: ``(name, value)`` or ``(name, (amount, seconds))`` for a
rate. NaN observations are kept out of means (a window without tool calls reports NaN for
``tools/failure_frequency``, as the spec says, because it has no observations at all).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

Observation = tuple[str, float | tuple[float, float]]


def reduction_for(name: str) -> str:
    """The reduction the spec prescribes for a metric name: rate, sum, max, min or mean."""
    last = name.rsplit("/", 1)[-1]
    if last.endswith("_per_s"):
        return "rate"
    words = last.split("_")
    for word, kind in (("count", "sum"), ("max", "max"), ("min", "min")):
        if word in words:
            return kind
    return "mean"


class MetricWindow:
    """Collects observations for one logging window and reduces them with `summarize`."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)
        self._rates: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def add(self, name: str, value: float) -> None:
        if reduction_for(name) == "rate":  # a mean of rates is not the spec's total over total
            raise ValueError(f"{name} is a rate: record it with add_rate(name, amount, seconds).")
        self._values[name].append(float(value))

    def add_rate(self, name: str, amount: float, seconds: float) -> None:
        total = self._rates[name]
        total[0] += float(amount)
        total[1] += float(seconds)

    def update(self, metrics: dict[str, float]) -> None:
        """Add one observation per entry (e.g. the metrics of one micro-batch)."""
        for name, value in metrics.items():
            self.add(name, value)

    def extend(self, observations: Iterable[Observation]) -> None:
        """Add observations in the cross-process tuple format."""
        for name, value in observations:
            if isinstance(value, tuple):
                self.add_rate(name, *value)
            else:
                self.add(name, value)

    def __bool__(self) -> bool:
        return bool(self._values) or bool(self._rates)

    def summarize(self) -> dict[str, float]:
        """Reduce the window and start a new one."""
        out: dict[str, float] = {}
        for name, values in self._values.items():
            out[name] = _reduce(reduction_for(name), values)
        for name, (amount, seconds) in self._rates.items():
            out[name] = amount / seconds if seconds > 0 else math.nan
        self._values = defaultdict(list)
        self._rates = defaultdict(lambda: [0.0, 0.0])
        return out


def _reduce(kind: str, values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    if kind == "sum":
        return float(sum(finite))
    if not finite:
        return math.nan
    if kind == "max":
        return max(finite)
    if kind == "min":
        return min(finite)
    return sum(finite) / len(finite)
