"""The run's last step flushes the worker's metrics before they are logged
(`StepSource.finish_step(last=True)`); which step is last is `is_last_step`'s rule.

Found in a fresh-clone run: a `max_steps=1` run logged no reward for its only step, because
the rule knew only prompt epochs, so a run bounded by max_steps never asked for the flush."""
from grpo_agent.train.step_source import is_last_step


def test_max_steps_reached_is_the_last_step():
    assert is_last_step(max_steps=1, global_step=1, epochs_done=False)
    assert is_last_step(max_steps=30, global_step=30, epochs_done=False)


def test_earlier_steps_are_not_last():
    assert not is_last_step(max_steps=30, global_step=29, epochs_done=False)
    assert not is_last_step(max_steps=-1, global_step=5, epochs_done=False)  # epochs decide


def test_prompt_epochs_done_is_the_last_step():
    assert is_last_step(max_steps=-1, global_step=5, epochs_done=True)

