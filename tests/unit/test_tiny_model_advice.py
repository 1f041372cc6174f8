"""A run of the built-in tiny model at the spec's default rate is told why it will not learn."""
import logging

import pytest
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train.run import tiny_model_advice


def test_the_default_rate_gets_the_settings_that_learn_and_a_demo_rate_gets_none():
    default_rate = AsyncGRPOConfig.__dataclass_fields__["learning_rate"].default
    advice = tiny_model_advice(default_rate)
    assert advice is not None and "learning_rate=1e-06" in advice
    assert "--set learning_rate=3e-4" in advice and "--model" in advice
    assert tiny_model_advice(3e-4) is None  # make demo-words' rate


def test_the_advice_calls_the_rate_the_default_only_when_it_is():
    # A user who set learning_rate=1e-5 was told "(the default is for pretrained models)".
    default_rate = AsyncGRPOConfig.__dataclass_fields__["learning_rate"].default
    assert "(the default, which is for pretrained models)" in tiny_model_advice(default_rate)
    set_rate = tiny_model_advice(1e-5)
    assert "learning_rate=1e-05 (set below 0.0001, a rate for pretrained models)" in set_rate
    assert "default" not in set_rate


def test_the_advice_starts_below_the_minimum_rate():
    from grpo_agent.train.run import TINY_MODEL_MIN_LEARNING_RATE

    assert tiny_model_advice(TINY_MODEL_MIN_LEARNING_RATE) is None
    assert tiny_model_advice(TINY_MODEL_MIN_LEARNING_RATE * 0.99) is not None


@pytest.mark.parametrize(("rank", "advised"), [("0", True), ("1", False)])
def test_under_torchrun_only_rank_0_gives_the_advice(tmp_path, monkeypatch, caplog, rank, advised):
    """Every rank runs run_training's checks; its warnings print on rank 0 only."""
    from grpo_agent.train import run

    class Stop(Exception):
        pass

    def no_server(*args, **kwargs):
        raise Stop

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(run, "_server", no_server)
    caplog.set_level(logging.INFO, logger="root")
    package = logging.getLogger("grpo_agent")
    level = package.level
    try:
        with pytest.raises(Stop):
            run.run_training("math", AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none"))
    finally:
        package.setLevel(level)  # what quiet_other_ranks set on rank 1
    assert any("learning_rate" in r.getMessage() for r in caplog.records) is advised
