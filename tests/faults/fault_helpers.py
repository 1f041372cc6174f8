"""Module-level faulty callables for the fault tests (the spawned worker imports them by name)."""
from __future__ import annotations

import time


def token_sum_reward(completion_ids, **kwargs):
    """Varied, policy-independent: 1 when the token ids sum to a multiple of 3."""
    return [float(sum(ids) % 3 == 0) for ids in completion_ids]


def hangs_on_row_3(completion_ids, row_id, **kwargs):
    """A remote judge that never answers for row 3; every other row gets a varied score."""
    if row_id[0] == 3:
        time.sleep(3600)
    return [float(i % 2) for i in range(len(completion_ids))]


def constant_reward(completion_ids, **kwargs):
    """Every rollout scores the same: zero reward std, so every group is dropped."""
    return [0.0] * len(completion_ids)
