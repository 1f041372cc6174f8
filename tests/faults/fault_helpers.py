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


FAULT_STARTED_ENV = "GRPO_FAULT_STARTED"  # a file path, set by the test, read by the worker


def _note_fault_start() -> None:
    """Write when the fault begins (time.time()) to the file named by `FAULT_STARTED_ENV`, once
    (the first call), if the test set it: a fault that begins inside the spawned worker times
    itself for `record_fault_to_outcome`."""
    path = os.environ.get(FAULT_STARTED_ENV)
    if path:
        try:
            with open(path, "x") as out:
                out.write(repr(time.time()))
        except FileExistsError:
            pass


def fault_started_at(path: Path, limit_s: float = 5.0) -> float:
    """The time a fault wrote with `_note_fault_start` (waits up to `limit_s` for the file)."""
    deadline = time.monotonic() + limit_s
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"the fault never wrote its start time to {path}"
        time.sleep(0.05)
    return float(path.read_text())


def hangs_on_row_3(completion_ids, row_id, **kwargs):
    """A remote judge that never answers for row 3; every other row gets a varied score. When
    it starts hanging it writes the time to GRPO_FAULT_STARTED (if set)."""
    if row_id[0] == 3:
        _note_fault_start()
        time.sleep(3600)
    return [float(i % 2) for i in range(len(completion_ids))]


def constant_reward(completion_ids, **kwargs):
    """Every rollout scores the same: zero reward std, so every group is dropped. Its first
    call (the first group about to be dropped) writes the time to GRPO_FAULT_STARTED (if set)."""
    _note_fault_start()
    return [0.0] * len(completion_ids)


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
                log.write(json.dumps({"killed_after_group": group.group_id, "at": time.time()}) + "\n")
        return super().compute_advantages(group)


def check_served_versions(groups_log: Path, pushed: int) -> float:
    """What the servers say they sampled with (vLLM's weight version per token), from
    `KillsTheServerAfterTheFirstPush`'s log: a group of model version v >= 1 was dispatched
    after version v was pushed, so every token of it comes from version v or a later push,
    never from a server's own weights ("default") or an older version; and groups scored after
    the kill were sampled with the version the restore pushed. Returns when the kill was sent."""
    lines = [json.loads(line) for line in groups_log.read_text().splitlines()]
    kill = next(i for i, line in enumerate(lines) if "killed_after_group" in line)
    groups = [line for line in lines if "group" in line]
    assert all(g["served"] for g in groups), "the server reported no weight version"
    for g in groups:
        if g["model_version"] >= 1:
            assert all(v.isdigit() and int(v) >= g["model_version"] for v in g["served"]), g
    after_kill = [g for g in lines[kill + 1:] if "group" in g]
    assert any(str(pushed) in g["served"] for g in after_kill), (pushed, after_kill)
    return lines[kill]["at"]


def timing_restores(when: list[float]):
    """`ServerRecovery.restore` that appends to `when` the time (time.time()) each restore
    returns: the recovery's end, for `record_fault_to_outcome`."""
    from grpo_agent.sampler.recovery import ServerRecovery

    restore = ServerRecovery.restore

    def timed(self, *args, **kwargs):
        metrics = restore(self, *args, **kwargs)
        when.append(time.time())
        return metrics

    return timed


def record_fault_to_outcome(record_property, seconds: float, deadline_s: float | None) -> None:
    """Note, for bench/faults.py's table, how long the case took from the injected fault to its
    outcome (the recovery, the report or the exit) and the deadline that bounds it (None: no
    stage deadline does). Recorded, never asserted: a timing assert would flake on a loaded CI
    box."""
    record_property("fault_to_outcome_s", round(seconds, 2))
    record_property("deadline_s", deadline_s)


class FailsOnRow1Env:
    """An environment whose reset fails for one task (row_id 1); the others' prompt is the row's."""

    def reset(self, row_id=None, **kwargs):
        if row_id == 1:
            raise ConnectionError("the game server refused task 1")
