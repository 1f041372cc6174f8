"""A run that cannot go on ends with a short message (what, where the log is, what to do) and
an exit code; the full traceback goes to error.log, and to the terminal only with --debug.

`run_training` is the seam: it raises what a real run raises at that point.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from grpo_agent.cli.main import DEBUG_ENV, main
from grpo_agent.rollout.worker import RolloutWorkerError, RolloutWorkerHung
from grpo_agent.stall import StageStalled


def _worker_failure() -> RolloutWorkerError:
    try:
        try:
            raise ConnectionError("vLLM server at http://127.0.0.1:9 refused the connection")
        except ConnectionError as cause:
            raise RuntimeError("generation failed after 3 retries") from cause
    except RuntimeError as inner:
        error = RolloutWorkerError("The rollout worker failed:\nTraceback (most recent call last):\n"
                                   '  File "loop.py", line 1, in generate\n'
                                   "RuntimeError: generation failed after 3 retries\n")
        error.__cause__ = inner
        return error


def _train(monkeypatch, capsys, tmp_path, error, *flags):
    from grpo_agent.train import run

    def failing(**kwargs):
        raise error

    monkeypatch.setattr(run, "run_training", failing)
    monkeypatch.setenv(DEBUG_ENV, "0")  # off, and recorded: the CLI may set it
    with pytest.raises(SystemExit) as exited:
        main([*flags, "train", "--env", "words", "--output-dir", str(tmp_path / "out")])
    return exited.value.code, capsys.readouterr().err


def test_a_failed_run_prints_what_where_and_what_to_do(monkeypatch, capsys, tmp_path):
    code, err = _train(monkeypatch, capsys, tmp_path, _worker_failure())
    assert code == 1
    lines = err.strip().splitlines()
    # The worker's traceback is in error.log; its last line, the reason, is on the terminal too.
    assert lines[0] == ("Error: the run failed: RolloutWorkerError: The rollout worker failed: "
                        "RuntimeError: generation failed after 3 retries")
    assert f"full traceback: {tmp_path / 'out' / 'error.log'}" in err
    assert "what to do:" in err and len(lines) <= 4
    assert "Traceback" not in err
    log = (tmp_path / "out" / "error.log").read_text()
    assert "ConnectionError: vLLM server at http://127.0.0.1:9 refused" in log  # chained causes too


def test_a_stall_exits_with_the_stall_code_and_names_its_report(monkeypatch, capsys, tmp_path):
    from grpo_agent.train import run

    def stalls(**kwargs):  # the run writes its report, then stops
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "stall_report.json").write_text("{}")
        raise StageStalled("STALL in the trainer: stage 'queue_pull' passed its 1 s deadline.")

    monkeypatch.setattr(run, "run_training", stalls)
    monkeypatch.setenv(DEBUG_ENV, "0")
    with pytest.raises(SystemExit) as exited:
        main(["train", "--env", "words", "--output-dir", str(tmp_path / "out")])
    assert exited.value.code == 3
    assert f"stall report: {tmp_path / 'out' / 'stall_report.json'}" in capsys.readouterr().err


def test_ctrl_c_exits_130_without_an_error_line(monkeypatch, capsys, tmp_path):
    """Ctrl-C exits 128 + SIGINT, as SIGTERM exits 143 (train/run.py): the run already logged
    that it was interrupted and how to go on, so no error line follows (typer >= 0.13 does
    this; 0.12 printed "Aborted!" and exited 1)."""
    code, err = _train(monkeypatch, capsys, tmp_path, KeyboardInterrupt())
    assert code == 128 + signal.SIGINT
    assert err == ""


def test_an_earlier_runs_stall_report_is_not_named(monkeypatch, capsys, tmp_path):
    """A run resumed into an output dir that holds a report of an earlier run's (recovered)
    stall fails for another reason: the report is not this failure's. (A hand-run resume whose
    reward then raised named the 80-minute-old report of a recovered scoring stall.)"""
    (tmp_path / "out").mkdir()
    old = tmp_path / "out" / "stall_report.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 4800, time.time() - 4800))
    code, err = _train(monkeypatch, capsys, tmp_path, RuntimeError("boom"))
    assert code == 1 and "stall report" not in err


def test_when_the_output_dir_cannot_be_written_the_traceback_goes_to_a_temp_file(monkeypatch, capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "error.log").mkdir()  # cannot be written as a file (works as root too)
    error = OSError(28, "No space left on device")
    code, err = _train(monkeypatch, capsys, tmp_path, error)
    assert code == 1 and "free disk space" in err
    path = err.split("full traceback: ")[1].split()[0]
    assert path.startswith("/tmp/grpo-agent-error-") and "No space left" in Path(path).read_text()
    os.unlink(path)


def test_with_debug_the_traceback_reaches_the_terminal(monkeypatch, capsys, tmp_path):
    from grpo_agent.train import run

    def failing(**kwargs):
        raise _worker_failure()

    monkeypatch.setattr(run, "run_training", failing)
    monkeypatch.setenv(DEBUG_ENV, "0")  # recorded (delenv of an absent name is not): --debug's "1" is undone after the test
    with pytest.raises(RolloutWorkerError):
        main(["--debug", "train", "--env", "words", "--output-dir", str(tmp_path / "out")])
    assert "ConnectionError" in (tmp_path / "out" / "error.log").read_text()


def test_without_a_stall_report_no_stall_report_line_is_printed(monkeypatch, capsys, tmp_path):
    code, err = _train(monkeypatch, capsys, tmp_path, RuntimeError("boom"))
    assert code == 1 and "stall report" not in err
    assert err.splitlines()[0] == "Error: the run failed: RuntimeError: boom"


def _advice_cases():
    from grpo_agent.rollout.scoring import RewardFunctionError
    from grpo_agent.sampler.errors import SamplerError
    from grpo_agent.train.no_progress import NoProgressStalled

    return [
        (StageStalled("STALL in the worker"), "read stall_report.json; raise stall_timeouts"),
        (NoProgressStalled("the last 8 groups were all dropped (8 zero_std)"),
         "no group trained: fix the likely cause named above"),
        (RewardFunctionError("reward 'accuracy' returned 3 scores for 4 completions"),
         "fix the reward function named above"),
        (SamplerError("the server answered 500"), "check the vLLM server"),
        (RolloutWorkerError("worker died"), "the rollout worker's traceback is in error.log"),
        # A hung worker sends no traceback: the advice is the heartbeat's (it pointed at
        # error.log's worker traceback for a worker SIGSTOPped mid-run).
        (RolloutWorkerHung("The rollout worker sent no heartbeat for 16 s (rollout_worker_timeout="
                           "10 s): it is hung."), "find what blocks the rollout worker"),
        (RuntimeError("anything else"), "read the traceback in error.log (or run with --debug)"),
    ]


@pytest.mark.parametrize("index", range(7))
def test_the_advice_names_the_next_step_for_each_kind_of_failure(tmp_path, index):
    from grpo_agent.cli.failure import report_failure

    error, advice = _advice_cases()[index]
    message, code = report_failure(error, tmp_path)
    assert message.splitlines()[-1].startswith(f"  what to do: {advice}"), message
    assert code == (3 if isinstance(error, StageStalled) else 1)


def test_the_advice_resumes_only_from_a_checkpoint_that_is_there(tmp_path):
    from grpo_agent.cli.failure import report_failure
    from grpo_agent.train.checkpoint import RolloutState

    message, _ = report_failure(RuntimeError("boom"), tmp_path)
    assert message.endswith("then run it again (no checkpoint was written yet to resume from)."), message
    (tmp_path / "checkpoint-6").mkdir()
    RolloutState().save(tmp_path / "checkpoint-6")
    message, _ = report_failure(RuntimeError("boom"), tmp_path)
    assert message.endswith("then resume from checkpoint-6 with --set resume_from_checkpoint=last.")


def test_a_first_run_that_asks_to_resume_is_refused_before_the_server_starts(monkeypatch, capsys,
                                                                            tmp_path):
    from grpo_agent.train import run

    def no_server(*args, **kwargs):
        raise AssertionError("the server was started for a run that cannot resume")

    monkeypatch.setattr(run, "_server", no_server)
    monkeypatch.setattr(run, "_tiny_model_path", no_server)
    monkeypatch.setenv(DEBUG_ENV, "0")
    with pytest.raises(SystemExit) as exited:
        main(["train", "--env", "words", "--output-dir", str(tmp_path / "out"),
              "--set", "resume_from_checkpoint=last"])
    err = capsys.readouterr().err
    assert exited.value.code == 1
    assert err.startswith(f"Error: Cannot resume: {tmp_path / 'out'} has no complete checkpoint-N"), err
    assert "Traceback" not in err and not (tmp_path / "out" / "error.log").exists()


def test_a_long_first_line_is_cut_and_the_log_holds_it_whole(tmp_path):
    from grpo_agent.cli.failure import report_failure

    message, _ = report_failure(RuntimeError("x" * 1000 + "\nsecond line"), tmp_path)
    first = message.splitlines()[0]
    assert first == ("Error: the run failed: RuntimeError: " + "x" * (180 - len("RuntimeError: "))
                     + " [...] " + "x" * 120)
    assert "x" * 1000 in (tmp_path / "error.log").read_text()


def test_a_cut_message_keeps_its_end_where_the_fix_is(tmp_path):
    """Seen against a server restarted without --weight-transfer-config: vLLM's long reason
    sits in the middle, the flag to restart with at the end, and a cut at 300 characters lost it."""
    from grpo_agent.cli.failure import report_failure

    error = RuntimeError("http://x refused to start gloo weight transfer: " + "vLLM said " * 40
                         + ". Start the server with --weight-transfer-config '{\"backend\": \"gloo\"}'.")
    first = report_failure(error, tmp_path)[0].splitlines()[0]
    assert first.startswith("Error: the run failed: RuntimeError: http://x refused to start gloo")
    assert first.endswith("Start the server with --weight-transfer-config '{\"backend\": \"gloo\"}'.")
    assert len(first) < 340
