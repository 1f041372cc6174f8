"""`OUTPUT_DIR/final`: the model a run saves once its training ends.

Design decision: the model is written into a sibling, `final.incomplete`, which is renamed to
`final` only once the save returned, so a `final` folder always holds a whole model (what
`grpo-agent eval --model OUTPUT_DIR/final` and `train --model` load); a save cut short by Ctrl-C,
SIGTERM or a kill leaves `final.incomplete`, whose name says what it is. An interrupted save
says so in one line, with the newest complete checkpoint and how to write `final` from it: a
resume from the run's last checkpoint (`step_source.ends_the_run`) trains nothing, starts no server and
saves `final`. Before, the run ended without a word and a half-written `final` looked like a
model.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

FINAL_NAME = "final"
INCOMPLETE_FINAL_NAME = "final.incomplete"

logger = logging.getLogger(__name__)


def save_final_model(trainer: Any, output_dir: str | Path) -> Path:
    """Save the trainer's model as `output_dir/final` (replacing an earlier run's); returns it.
    Every process calls it (an FSDP2 save gathers on all); the one that writes renames."""
    final = Path(output_dir) / FINAL_NAME
    partial = final.with_name(INCOMPLETE_FINAL_NAME)
    writes = trainer.args.should_save
    if writes and partial.exists():
        shutil.rmtree(partial)  # an earlier save cut short: its files are not this model's
    try:
        # transformers' own push in save_model would upload `final.incomplete`: done after
        trainer.save_model(str(partial), _internal_call=True)
    except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C, or SIGTERM (`grpo-agent train`)
        logger.warning(interrupted_save(stop, final, trainer.state.global_step,
                                        trainer.resume_setting))
        raise
    if writes:
        if final.exists():
            shutil.rmtree(final)  # an earlier run's into the same output dir
        partial.rename(final)
    if trainer.args.push_to_hub:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)
    return final


def interrupted_save(stop: BaseException, final: Path, step: int, setting: str) -> str:
    """One line: the save was cut short, what it left, and the newest complete checkpoint with
    how to write `final` from it (`setting`: how this entry point resumes, `resume_advice`)."""
    from grpo_agent.train.checkpoint import last_complete_checkpoint, resume_advice
    from grpo_agent.train.trainer import interruption

    last = last_complete_checkpoint(final.parent)
    earlier = f" {final} is still an earlier run's model." if final.exists() else ""
    if last is None:
        kept = "No complete checkpoint-N was written (see save_strategy): run it again."
    else:
        done = last.name.split("-")[-1]
        then = (" (the run's last step: it trains nothing and starts no server)"
                if done == str(step) else f" (the steps after {done} are trained again)")
        kept = (f"The newest complete checkpoint is {last} (step {done} of {step}). To write "
                f"{final}, {resume_advice(final.parent, setting)}{then}.")
    return (f"The save of the final model to {final} was interrupted ({interruption(stop)}): "
            f"{final.with_name(INCOMPLETE_FINAL_NAME)} may be incomplete and is no model to "
            f"use.{earlier} {kept}")

