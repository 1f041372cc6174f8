"""`python -m grpo_agent.testing.warmup` off a terminal: a build that took 40 minutes on a busy
2-core box printed nothing until its folder (a bar shows nothing in a log), so a log could not
tell a live build from a hung one."""
from __future__ import annotations

import pytest
from grpo_agent.testing import warmup
from grpo_agent.train import reporting


@pytest.mark.parametrize(("interval_s", "shown"), [(3600.0, [0, 3]), (0.0, [0, 1, 2, 3])])
def test_the_warmup_prints_its_phase_and_steps_as_plain_lines_off_a_terminal(
        capsys, monkeypatch, interval_s, shown):
    """stderr captured (not a terminal): the phase's first line, a step per interval, its end."""
    monkeypatch.setattr(reporting, "PLAIN_LINE_INTERVAL_S", interval_s)
    assert list(warmup._steps(3, show_progress=True)) == [0, 1, 2]
    lines = capsys.readouterr().err.splitlines()
    assert [line.partition("  [")[0] for line in lines] == [
        f"tool-call warm-up of the tiny model: step {step}/3" for step in shown]
    assert all(line.endswith("]") for line in lines)
