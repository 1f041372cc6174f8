"""A run that stops on an error or a signal logs what it counted since its last logged step.

Found in a new-user trial: an external vLLM server was SIGKILLed mid-run, the trainer waited
`vllm_server_timeout` for it and stopped, and `rollout/server_lost_group_count` never reached
metrics.jsonl (it is logged with a step's window, and no step ended after the loss), so the
dead run's files did not say that groups were lost. The trainer is real (tiny model, CPU) and
so is the restore that gives up; the rollout worker is a stand-in."""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_agent import AsyncGRPOConfig
from grpo_agent.sampler.errors import ServerUnreachableError
from grpo_agent.testing import build_tiny_model
from grpo_agent.testing.offline import OfflineTrainer, ScriptedWorker
from grpo_agent.train.reporting import METRICS_NAME, JsonlMetricsCallback, read_metrics
from grpo_agent.train.trainer import STOP_WINDOW_STEPS
from transformers import TrainerCallback

from .test_step_read import TOKEN_BUDGET, group


class LosesTheServer(ScriptedWorker):
    """One step's samples, then the server is gone: the worker drops a group, counts it and
    waits for a restore. Like the real worker, its last observations reach the trainer when it
    is stopped (`RolloutWorker.stop` keeps them for `drain_metrics`)."""

    def __init__(self, samples):
        super().__init__(samples)
        self.server_down = False
        self._observations = []

    def pull(self, timeout, version=None):
        items = super().pull(timeout)
        self.server_down = not items
        return items

    def stop(self, grace_s=None):
        if self.server_down:
            self._observations.append(("rollout/server_lost_group_count", 1.0))

    def drain_metrics(self):
        observations, self._observations = self._observations, []
        return observations


class LosingTrainer(OfflineTrainer):
    def start_pipeline(self):
        super().start_pipeline()
        self.source = self._step_source(LosesTheServer(list(self.samples)))


def closed_port_url() -> str:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{free.getsockname()[1]}"


@pytest.mark.parametrize("save_each_step", [False, True])
def test_a_run_stopped_by_a_lost_server_logs_the_groups_it_lost(tmp_path, save_each_step):
    """Without saves, the loss comes while step 1 plans step 2 ahead, before step 1 is logged;
    a step that saves is logged before the next pull. Either way the last row, without a loss
    (no step was read after it), carries what was counted since."""
    saves = {"save_strategy": "steps", "save_steps": 1} if save_each_step else {"save_strategy": "no"}
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=3, logging_steps=1, token_budget=TOKEN_BUDGET,
        gradient_checkpointing=False, optim="adamw_torch", report_to="none",
        disable_tqdm=True, use_cpu=True, vllm_server_base_url=closed_port_url(),
        vllm_server_timeout=1, **saves)
    trainer = LosingTrainer(build_tiny_model(), args=args, reward_funcs=[],
                            train_dataset=[{"prompt": []}] * 64)
    trainer.samples = [s for g in range(2) for s in group(g)]  # step 1, and one it carries
    trainer.add_callback(JsonlMetricsCallback())
    with pytest.raises(ServerUnreachableError, match="did not come back"):
        trainer.train()
    rows = read_metrics(tmp_path / METRICS_NAME)
    assert [row["step"] for row in rows] == ([1, 1] if save_each_step else [1])
    assert rows[-1].get("rollout/server_lost_group_count") == 1.0
    assert "loss" not in rows[-1]
    assert rows[-1][STOP_WINDOW_STEPS] == (0 if save_each_step else 1)  # step 1 logged or not
    assert ("loss" in rows[0]) is save_each_step


class LosesTheServerQuietly(LosesTheServer):
    """Loses the server like `LosesTheServer` but has counted nothing when stopped."""

    def stop(self, grace_s=None):
        pass


class QuietLosingTrainer(OfflineTrainer):
    def start_pipeline(self):
        super().start_pipeline()
        self.source = self._step_source(LosesTheServerQuietly(list(self.samples)))


def run_until_the_server_is_lost(tmp_path, trainer_class, setup=lambda trainer: None):
    """Step 1 is saved and logged, then the server is gone: the run fails with the lost
    server's error. Returns the rows of metrics.jsonl."""
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=3, logging_steps=1, token_budget=TOKEN_BUDGET,
        gradient_checkpointing=False, optim="adamw_torch", report_to="none",
        disable_tqdm=True, use_cpu=True, vllm_server_base_url=closed_port_url(),
        vllm_server_timeout=1, save_strategy="steps", save_steps=1)
    trainer = trainer_class(build_tiny_model(), args=args, reward_funcs=[],
                            train_dataset=[{"prompt": []}] * 64)
    trainer.samples = [s for g in range(2) for s in group(g)]
    trainer.add_callback(JsonlMetricsCallback())
    setup(trainer)
    with pytest.raises(ServerUnreachableError, match="did not come back"):
        trainer.train()
    return read_metrics(tmp_path / METRICS_NAME)


def test_a_failed_run_that_counted_nothing_since_its_last_step_adds_no_row(tmp_path):
    """Nothing counted after step 1 was logged: no empty row is logged after it (a row of
    nothing but a step number would read as a step that logged no metrics)."""
    rows = run_until_the_server_is_lost(tmp_path, QuietLosingTrainer)
    assert [row["step"] for row in rows] == [1]
    assert "loss" in rows[0]


def test_logging_the_unlogged_window_never_hides_the_runs_error(tmp_path, caplog):
    """If logging the last window fails, the run's own error (the lost server) is still the
    one raised; the logging failure is only logged."""
    def setup(trainer):
        stop_pipeline = trainer._stop_pipeline

        def stop_and_break_the_summary(**kwargs):  # step 1 was summarised: break it from now
            def broken_summary():
                raise RuntimeError("summary bug")
            trainer.window_summary = broken_summary
            return stop_pipeline(**kwargs)
        trainer._stop_pipeline = stop_and_break_the_summary

    run_until_the_server_is_lost(tmp_path, LosingTrainer, setup)
    assert "Logging the metrics counted since the last logged step failed" in caplog.text


class CountsWhenStopped(ScriptedWorker):
    """A worker with a group still in flight at the run's end: the tool call it made reaches
    the trainer only as the worker stops (as the real one's, `RolloutEngine._send_last_observations`),
    once."""

    stopped = drained = False

    def finish(self, timeout_s):
        self.stopped = True
        return True

    def stop(self, grace_s=None):
        self.stopped = True

    def drain_metrics(self):
        if not self.stopped or self.drained:
            return []
        self.drained = True
        return [("tools/lookup/call_count", 1.0), ("tools/lookup/cancelled_count", 1.0)]


class FinishingTrainer(OfflineTrainer):
    def start_pipeline(self):
        super().start_pipeline()
        self.source = self._step_source(CountsWhenStopped(list(self.samples)))


def test_a_run_that_ends_well_logs_the_groups_in_flight_in_its_last_steps_row(tmp_path):
    """A finished run stops the worker at its last step, so the tool call of a group still in
    flight is logged in that step's row, and no row comes after it but HF's run summary.
    Before, the worker was stopped after train() and what its groups in flight sent was
    dropped: the call was in no row."""
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, logging_steps=1, token_budget=TOKEN_BUDGET,
        gradient_checkpointing=False, optim="adamw_torch", report_to="none",
        disable_tqdm=True, use_cpu=True, save_strategy="no")
    trainer = FinishingTrainer(build_tiny_model(), args=args, reward_funcs=[],
                               train_dataset=[{"prompt": []}] * 64)
    trainer.samples = [s for g in range(2) for s in group(g)]  # step 1, and one that closes it
    trainer.add_callback(JsonlMetricsCallback())
    trainer.train()
    rows = read_metrics(tmp_path / METRICS_NAME)
    assert len(rows) == 2 and "train_runtime" in rows[1]  # step 1, then HF's run summary
    assert "loss" in rows[0] and rows[0]["tools/lookup/call_count"] == 1.0
    assert rows[0]["tools/lookup/cancelled_count"] == 1.0


SIGNAL_SCRIPT = Path(__file__).parent / "stop_by_signal_script.py"


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored here, so a child started meanwhile inherits it ignored, as every child of
    a test runner started as a background job (`make test &`) does."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(("sig", "named", "exit_codes"), [
    (signal.SIGTERM, "SIGTERM", {128 + signal.SIGTERM}),  # `grpo-agent train`'s handler
    # Ctrl-C: an uncaught KeyboardInterrupt, exit 1 (not -2: torch._dynamo's exit hook runs an
    # exec, which clears CPython's note to die by SIGINT). `grpo-agent train` exits 130.
    (signal.SIGINT, "KeyboardInterrupt", {1, -signal.SIGINT}),
], ids=["SIGTERM", "SIGINT"])
def test_a_run_stopped_by_a_signal_logs_the_steps_it_had_not_logged(tmp_path, sig, named, exit_codes):
    """With logging_steps=2, step 2 is logged, step 3 trains, and the run waits for samples
    when the signal comes from outside: the last row holds step 3's window, marked as a stop's
    (`stop/window_steps`, no `loss`), and every tool failure the worker counted is in exactly
    one row. Before, an interrupted run logged nothing after step 2.

    The run starts with SIGINT ignored, as under a test runner started as a background job:
    before the script set its handler, such a run never saw the Ctrl-C and waited for samples
    past the 60 s guard: the likely cause of its failure in the CI rehearsal at acd112f (load
    alone never kept it past 13 s)."""
    log = tmp_path / "run.log"
    with log.open("w") as out, sigint_ignored():
        proc = subprocess.Popen([sys.executable, str(SIGNAL_SCRIPT), str(tmp_path)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "waiting").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never ran dry"
            time.sleep(0.1)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        assert code in exit_codes, log.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
    assert f"The run was interrupted ({named}) at step 3" in log.read_text()
    rows = read_metrics(tmp_path / METRICS_NAME)
    assert [row["step"] for row in rows] == [2, 3]
    assert "loss" in rows[0] and STOP_WINDOW_STEPS not in rows[0]
    assert "loss" not in rows[1] and rows[1][STOP_WINDOW_STEPS] == 1
    handed = int((tmp_path / "waiting").read_text())
    assert sum(row.get("tools/search/failure_count", 0) for row in rows) == handed


class CtrlCAtStep3(TrainerCallback):
    """Ctrl-C once, after step 3 was read (its loss is in the unlogged window)."""

    def __init__(self):
        self.armed = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.armed and state.global_step == 3:
            self.armed = False
            raise KeyboardInterrupt


def saving_trainer(output_dir):
    """Steps 1-4 of one group each, logged every 2 steps, saved every 2."""
    args = AsyncGRPOConfig(
        output_dir=str(output_dir), max_steps=4, logging_steps=2, token_budget=TOKEN_BUDGET,
        gradient_checkpointing=False, optim="adamw_torch", report_to="none", disable_tqdm=True,
        use_cpu=True, save_strategy="steps", save_steps=2)
    trainer = OfflineTrainer(build_tiny_model(), args=args, reward_funcs=[],
                             train_dataset=[{"prompt": []}] * 64)
    trainer.samples = [s for g in range(5) for s in group(g)]
    return trainer


def test_a_resume_after_ctrl_c_in_the_same_process_logs_only_its_own_losses(tmp_path):
    """Ctrl-C at step 3, then `trainer.train(resume_from_checkpoint=True)` (the interrupt's
    advice to a Python run): the resume trains steps 3 and 4 from checkpoint-2, and its step-4
    loss is that of a fresh trainer resumed from checkpoint-2. Before, the stopped run's step-3
    loss was averaged into it as well (counted twice: step 3 is trained again)."""
    trainer = saving_trainer(tmp_path)
    trainer.add_callback(CtrlCAtStep3())
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    trainer.train(resume_from_checkpoint=True)
    fresh = saving_trainer(tmp_path / "fresh")
    fresh.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    def step_4_loss(trainer):
        return next(row["loss"] for row in trainer.state.log_history
                    if row["step"] == 4 and "loss" in row)

    assert step_4_loss(trainer) == pytest.approx(step_4_loss(fresh))
