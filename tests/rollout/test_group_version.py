"""A group's rollouts sample the policy the group started under, even when a push lands
mid-group: the engine pins the version for the group's task and the rollout tasks it starts."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from grpo_agent.rollout import engine as engine_module
from grpo_agent.rollout.versions import VersionValue, rollout_version


class GroupBuilt(Exception):
    """Raised in place of building the group: the test ends there."""


def test_a_push_mid_group_leaves_the_groups_rollouts_on_its_version(monkeypatch):
    channels = SimpleNamespace(model_version=VersionValue(5))
    config = SimpleNamespace(num_generations=3, share_first_turn_request=False)
    engine = engine_module.RolloutEngine(SimpleNamespace(config=config), channels)
    seen = []

    async def rollout(slot, group_id, took_slot, shared, calls):
        if not seen:
            channels.model_version.value = 6  # the trainer pushed while the group runs
        await asyncio.sleep(0)
        seen.append(rollout_version())

    async def build_group(loop, slot, group_id, version, results, *args):
        raise GroupBuilt(version)

    monkeypatch.setattr(engine, "_run_rollout", rollout)
    monkeypatch.setattr(engine_module, "build_group", build_group)
    with pytest.raises(GroupBuilt) as built:
        asyncio.run(engine._run_group(SimpleNamespace(prompt_index=0, row_index=0), 0))
    assert seen == [5, 5, 5] and built.value.args == (5,)
