"""The spec's import paths (`trl.trainer.async_grpo_trainer`, `trl.trainer.async_grpo_config`
with `trl` -> `grpo_agent`) name the project's own classes: aliases, not copies."""
from __future__ import annotations

import subprocess
import sys


def test_the_specs_rollout_import_line_gives_the_projects_classes():
    import grpo_agent
    from grpo_agent import types
    from grpo_agent.rollout import loop
    from grpo_agent.trainer.async_grpo_trainer import (  # the spec's line, trl -> grpo_agent
        AsyncRolloutLoop,
        Rollout,
        RolloutGroup,
        TrainingSequence,
        TurnRecord,
    )

    assert AsyncRolloutLoop is loop.AsyncRolloutLoop is grpo_agent.AsyncRolloutLoop
    assert Rollout is types.Rollout and TurnRecord is types.TurnRecord
    assert RolloutGroup is types.RolloutGroup and TrainingSequence is types.TrainingSequence


def test_the_trainer_and_config_resolve_to_the_same_classes():
    import grpo_agent
    from grpo_agent.trainer.async_grpo_config import AsyncGRPOConfig
    from grpo_agent.trainer.async_grpo_trainer import AsyncGRPOTrainer

    assert AsyncGRPOTrainer is grpo_agent.AsyncGRPOTrainer
    assert AsyncGRPOConfig is grpo_agent.AsyncGRPOConfig


def test_importing_the_loop_alias_does_not_load_the_trainer():
    """A custom loop module imports it in the rollout worker, which never trains."""
    code = ("import sys; from grpo_agent.trainer.async_grpo_trainer import AsyncRolloutLoop; "
            "print('grpo_agent.train.trainer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
