"""Module-level faulty callables for the fault tests (the spawned worker imports them by name)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from grpo_agent.rollout.loop import AsyncRolloutLoop


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


def kills_the_server_at_group_3(completion_ids, **kwargs):
    """token_sum_reward that SIGKILLs the vLLM server (pid in GRPO_FAULT_SERVER_PID) once, when
    the third group is scored: other groups are generating then. The marker file makes it once
    per test, across calls in the worker process."""
    marker = Path(os.environ["GRPO_FAULT_MARKER"])
    calls = int(marker.read_text() or 0) + 1 if marker.exists() else 1
    marker.write_text(str(calls))
    if calls == 3:
        os.kill(int(os.environ["GRPO_FAULT_SERVER_PID"]), signal.SIGKILL)
    return token_sum_reward(completion_ids)


class KillsTheServerAfterTheFirstPush(AsyncRolloutLoop):
    """The default loop, recording for each scored group its model version and the weight
    versions the server says it sampled the group's tokens with (one JSON line per group in
    GRPO_FAULT_GROUPS). It SIGKILLs the server (pid in GRPO_FAULT_SERVER_PID) once, as it scores
    the first group of model version 1 or later: after the first push, so the restore must push
    a trained version (a kill before any push is restored by the fresh server's own weights)."""

    killed = False

    def compute_advantages(self, group):
        served = sorted({v for rollout in group.rollouts for turn in rollout.turns
                         for v in turn.weight_versions or ()})
        entry = {"group": group.group_id, "model_version": group.model_version, "served": served}
        with Path(os.environ["GRPO_FAULT_GROUPS"]).open("a") as log:
            log.write(json.dumps(entry) + "\n")
            if group.model_version >= 1 and not self.killed:
                self.killed = True
                os.kill(int(os.environ["GRPO_FAULT_SERVER_PID"]), signal.SIGKILL)
                log.write(json.dumps({"killed_after_group": group.group_id}) + "\n")
        return super().compute_advantages(group)


class FailsOnRow1Env:
    """An environment whose reset fails for one task (row_id 1); the others' prompt is the row's."""

    def reset(self, row_id=None, **kwargs):
        if row_id == 1:
            raise ConnectionError("the game server refused task 1")
