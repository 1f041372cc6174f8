"""The final save: `final` appears only whole, and Ctrl-C during it says what it left.

Before, `run_training` saved straight into `OUTPUT_DIR/final`, and a Ctrl-C there ended the run
without a word, leaving a half-written `final` that looked like a model."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo_agent import AsyncGRPOConfig
from grpo_agent.testing import build_tiny_model
from grpo_agent.testing.offline import OfflineTrainer
from grpo_agent.train.final_model import interrupted_save, save_final_model

from .test_stopped_run_metrics import sigint_ignored

SCRIPT = Path(__file__).parent / "final_save_script.py"


def test_ctrl_c_during_the_final_save_says_what_it_left_and_ends_by_sigint(tmp_path):
    """`grpo-agent train` (real CLI and run, offline trainer) gets SIGINT while its final save
    runs: one line says the save to final was interrupted, that final.incomplete may be
    incomplete, and names checkpoint-1; the run still ends by SIGINT, and no `final` folder
    exists. Started with SIGINT ignored, as under a test runner run as a background job."""
    out, log = tmp_path / "out", tmp_path / "run.log"
    with log.open("w") as sink, sigint_ignored():
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out)], stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (out / "saving").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached its final save"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
    text = log.read_text()
    assert code == -signal.SIGINT, text[-3000:]
    said = (f"The save of the final model to {out / 'final'} was interrupted (KeyboardInterrupt): "
            f"{out / 'final.incomplete'} may be incomplete and is no model to use. The newest "
            f"complete checkpoint is {out / 'checkpoint-1'} (step 1 of 1).")
    assert text.count(said) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not (out / "final").exists() and (out / "final.incomplete").is_dir()


def test_a_finished_save_replaces_an_earlier_final_and_leaves_no_partial_folder(tmp_path):
    """A run into an output dir that holds an earlier run's `final` and a save cut short: the
    new model replaces the one, the other is gone. A hub push (transformers' own, in
    `save_model`) comes only once `final` holds the model, not `final.incomplete`."""
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = OfflineTrainer(build_tiny_model(), args=args, reward_funcs=[],
                             train_dataset=[{"prompt": []}] * 4)
    for name in ("final", "final.incomplete"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "stale.bin").write_text("an earlier save's")
    pushed = []
    trainer.args.push_to_hub = True
    trainer.push_to_hub = lambda **kwargs: pushed.append(sorted(p.name for p in tmp_path.iterdir()))
    final = save_final_model(trainer, tmp_path)
    assert final == tmp_path / "final"
    assert (final / "config.json").is_file() and list(final.glob("model*.safetensors"))
    assert not (final / "stale.bin").exists() and not (tmp_path / "final.incomplete").exists()
    assert pushed == [["final"]]


def test_an_interrupted_save_without_checkpoints_says_so_and_names_an_earlier_final(tmp_path):
    """No checkpoint-N to fall back on (save_strategy=no), and a `final` an earlier run into the
    same output dir left: the line says both, so neither is taken for this run's model."""
    (tmp_path / "final").mkdir()
    (tmp_path / "checkpoint-3").mkdir()  # cut short too: no rollout_state.json
    said = interrupted_save(SystemExit(128 + signal.SIGTERM), tmp_path / "final", 7)
    assert said == (
        f"The save of the final model to {tmp_path / 'final'} was interrupted (SIGTERM): "
        f"{tmp_path / 'final.incomplete'} may be incomplete and is no model to use. "
        f"{tmp_path / 'final'} is still an earlier run's model. No complete checkpoint-N was "
        "written (see save_strategy): run it again.")
