"""A RolloutEngine on stand-in channels and loop: for tests that drive its group logic alone."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from grpo_agent.rollout import engine as engine_module
from grpo_agent.rollout.concurrency import RolloutSlots
from grpo_agent.rollout.versions import VersionValue


def make_engine(num_generations=2, cap=64, **loop):
    """The engine and the list its finished samples are put on; `loop` adds rollout-loop
    fields (tools, run_episode, ...) to a config of `num_generations` and max_staleness 1."""
    config = SimpleNamespace(max_staleness=1, num_generations=num_generations, seed=0,
                             share_first_turn_request=False, vllm_server_base_url="http://x")
    put = []
    channels = SimpleNamespace(samples=SimpleNamespace(put=put.append),
                               token_allowance=SimpleNamespace(value=0.0),
                               model_version=VersionValue(0), server_down=None,
                               server_restores=None)
    engine = engine_module.RolloutEngine(SimpleNamespace(config=config, server=None, **loop),
                                         channels)
    engine.slots = RolloutSlots(SimpleNamespace(value=cap))
    engine.score_queue = asyncio.Queue(16)
    return engine, put


def engine_on(loop, cap=64):
    """A RolloutEngine driving the real rollout `loop` on stand-in channels, as the worker's
    pipeline sees them (stop and flush events, a heartbeat, an open allowance); returns the
    engine, the list its samples and notices are put on, and the list of metric batches sent."""
    import threading

    put, batches = [], []
    channels = SimpleNamespace(samples=SimpleNamespace(put=put.append),
                               metrics=SimpleNamespace(put=batches.append),
                               token_allowance=SimpleNamespace(value=1e9),
                               model_version=VersionValue(0), server_down=None,
                               server_restores=None, heartbeat=SimpleNamespace(value=0.0),
                               stop=threading.Event())
    engine = engine_module.RolloutEngine(loop, channels)
    engine.cap = SimpleNamespace(value=cap)
    engine.slots = RolloutSlots(engine.cap)
    return engine, put, batches
