"""The final save: `final` appears only whole, Ctrl-C during it says what it left and how to
write `final` from the newest checkpoint, and a resume from the run's last step only saves it.

Before, `run_training` saved straight into `OUTPUT_DIR/final`, and a Ctrl-C there ended the run
without a word, leaving a half-written `final` that looked like a model."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_agent import AsyncGRPOConfig
from grpo_agent.testing import build_tiny_model
from grpo_agent.testing.offline import OfflineTrainer
from grpo_agent.train.checkpoint import CLI_RESUME, PYTHON_RESUME
from grpo_agent.train.final_model import interrupted_save, save_final_model
from safetensors.torch import load_file

from .test_step_read import TOKEN_BUDGET, group
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
            f"complete checkpoint is {out / 'checkpoint-1'} (step 1 of 1). To write "
            f"{out / 'final'}, resume from checkpoint-1 with --set resume_from_checkpoint=last "
            "(the run's last step: it trains nothing and starts no server).")
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
    said = interrupted_save(SystemExit(128 + signal.SIGTERM), tmp_path / "final", 7, CLI_RESUME)
    assert said == (
        f"The save of the final model to {tmp_path / 'final'} was interrupted (SIGTERM): "
        f"{tmp_path / 'final.incomplete'} may be incomplete and is no model to use. "
        f"{tmp_path / 'final'} is still an earlier run's model. No complete checkpoint-N was "
        "written (see save_strategy): run it again.")


def test_an_interrupted_save_after_a_checkpoint_before_the_end_says_the_resume_trains_again(
        tmp_path):
    """The newest checkpoint is not the last step's (save_steps=2 of 3): the resume the line
    names trains the steps after it again, in the entry point's own spelling."""
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "rollout_state.json").write_text("{}")
    said = interrupted_save(KeyboardInterrupt(), tmp_path / "final", 3, PYTHON_RESUME)
    assert said.endswith(
        f"The newest complete checkpoint is {tmp_path / 'checkpoint-2'} (step 2 of 3). To write "
        f"{tmp_path / 'final'}, resume from checkpoint-2 with "
        "trainer.train(resume_from_checkpoint=True) (the steps after 2 are trained again).")


def _offline_run(output_dir, **config):
    """An offline run of one-group steps on 2 prompts (trainer and checkpoints real, no server);
    a third group closes a max_steps=2 run's last step."""
    args = AsyncGRPOConfig(**{
        "output_dir": str(output_dir), "token_budget": TOKEN_BUDGET, "learning_rate": 3e-4,
        "gradient_checkpointing": False, "optim": "adamw_torch", "report_to": "none",
        "disable_tqdm": True, "use_cpu": True, **config})
    trainer = OfflineTrainer(build_tiny_model(), args=args, reward_funcs=[],
                             train_dataset=[{"prompt": []}] * 2)
    trainer.samples = [s for g in range(3) for s in group(g)]
    return trainer


def test_a_cli_resume_from_the_runs_last_step_only_saves_final_without_a_server(
        tmp_path, monkeypatch):
    """The interrupted save's advice followed: `run_training` (real trainer, no --vllm-url)
    resumed from checkpoint-2 of a max_steps=2 run starts no server, trains nothing and writes
    `final` with the checkpoint's weights. Before, it started a managed vLLM server (minutes on
    CPU) to push the weights and spawn a rollout worker, then trained nothing."""
    from grpo_agent.sampler import server
    from grpo_agent.train.run import run_training

    out = tmp_path / "out"
    _offline_run(out, max_steps=2, save_strategy="steps", save_steps=2).train()
    (out / "final.incomplete").mkdir()  # what the cut-short save left

    def no_server(*args, **kwargs):
        raise AssertionError("a resume at the run's last step started a vLLM server")

    monkeypatch.setattr(server, "ManagedVLLMServer", no_server)
    config = AsyncGRPOConfig(output_dir=str(out), max_steps=2, resume_from_checkpoint="last",
                             use_cpu=True, report_to="none", learning_rate=3e-4)
    run_training("words", config)
    final, saved = load_file(out / "final" / "model.safetensors"), load_file(
        out / "checkpoint-2" / "model.safetensors")
    assert final.keys() == saved.keys() and all((final[k] == saved[k]).all() for k in final)
    assert sorted(p.name for p in out.glob("*checkpoint*")) == ["checkpoint-2"]
    assert not (out / "final.incomplete").exists()


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy, harmless
def test_a_finished_runs_summary_reprinted_gives_the_runs_own_eval_advice(tmp_path, monkeypatch,
                                                                          capsys):
    """`run_training` records its env in run.json, so `python -m grpo_agent.train.reporting RUN`
    gives the advice the run's end gave. Before, the reprint knew no env: for `words`, which
    declares no eval split, it said to run `grpo-agent eval --env ENV --model RUN/final`, which
    `grpo-agent eval --env words` refuses. (A run finished without a server: the resume from its
    last step.)"""
    import json
    import runpy

    from grpo_agent.train.run import run_training

    out = tmp_path / "out"
    _offline_run(out, max_steps=2, save_strategy="steps", save_steps=2).train()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 0.1, "reward": 0.5}) + "\n")
    run_training("words", AsyncGRPOConfig(output_dir=str(out), max_steps=2, use_cpu=True,
                                          resume_from_checkpoint="last", report_to="none",
                                          learning_rate=3e-4))
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["reporting", str(out)])
    runpy.run_module("grpo_agent.train.reporting", run_name="__main__")
    held_out = capsys.readouterr().out.splitlines()[1]
    assert "the env declares no eval split" in held_out and "grpo-agent eval" not in held_out


def test_a_resume_from_the_last_step_of_an_epoch_bounded_run_trains_no_extra_step(tmp_path):
    """num_train_epochs ends the run at step 2 (save_strategy=epoch checkpoints it): resumed
    from there, train() loads it and returns without the pipeline. Before, the Trainer (which
    sees no end in steps) pulled an empty step, trained it as step 3 and saved checkpoint-3."""
    _offline_run(tmp_path, num_train_epochs=1, save_strategy="epoch").train()
    assert (tmp_path / "checkpoint-2").is_dir()
    resumed = _offline_run(tmp_path, num_train_epochs=1, save_strategy="epoch")
    resumed.start_pipeline = lambda: pytest.fail("the resume started the rollout pipeline")
    output = resumed.train(resume_from_checkpoint=True)
    assert output.global_step == resumed.state.global_step == 2
    assert not (tmp_path / "checkpoint-3").exists()
    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    assert all((param.detach() == saved[name]).all()
               for name, param in resumed.model.named_parameters())
    assert resumed.recheck_served  # nothing pushed: evaluate() serves the weights first
