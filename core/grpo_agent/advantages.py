"""Group-normalised advantages, the spec's default estimator (registered as `group_norm` by
`plugins/builtins.py`; plugins that wrap it import it from here)."""
from __future__ import annotations

from typing import Any


def group_norm(group: Any) -> Any:
    """(r - mean) / std within the group over non-NaN rewards; NaN rewards and std=0 give 0.

    `group` is a `RolloutGroup` (anything with `rewards`); returns a float array.
    """
    import numpy as np  # lazily: plugins load at CLI start-up, which must stay fast

    rewards = np.asarray(group.rewards, dtype=float)
    advantages = np.zeros(len(rewards))
    scored = ~np.isnan(rewards)
    if scored.sum() < 2:
        return advantages
    values = rewards[scored]
    std = values.std()
    if std > 0:
        advantages[scored] = (values - values.mean()) / std
    return advantages
