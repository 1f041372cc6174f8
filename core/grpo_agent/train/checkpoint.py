"""Which prompts are trained, and `rollout_state.json`: resume without losing or repeating one.

The worker runs ahead of training by the queue depth, so the generator's position is useless
for resume. The trainer keeps a ledger of prompt indices instead: a prompt is *consumed* once all
of its kept group's samples were trained, or once the worker reports it consumed without
samples (filtered, zero-std or stale-dropped group). The first index not consumed is the resume
point; indices above it that were already consumed are saved too, and on resume their samples
are discarded at pull time, so nothing trains twice even though prompts finish out of order.

A prompt whose samples were partly trained when the checkpoint was written is not consumed:
after resume it is generated and trained again as a whole (its partial update lives in the
restored weights; that is the documented buffer).
"""
from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from grpo_agent.types import PromptConsumed, TrainingSample

ROLLOUT_STATE_NAME = "rollout_state.json"
LEDGER_NAME = "prompt_ledger.jsonl"


@dataclass
class RolloutState:
    """What `rollout_state.json` holds."""

    first_untrained_prompt_index: int = 0
    consumed_after_first: list[int] = field(default_factory=list)
    model_version: int = 0

    def save(self, checkpoint_dir: str | Path) -> Path:
        """Written last and atomically: its presence marks a checkpoint as complete."""
        path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(self.__dict__, indent=2) + "\n")
        partial.replace(path)
        return path

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> RolloutState:
        path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint was not written by AsyncGRPOTrainer, so the "
                "rollout position is unknown. Resume from a checkpoint-N folder of an async run."
            )
        check_checkpoint(checkpoint_dir)
        data = json.loads(path.read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def check_checkpoint(checkpoint_dir: str | Path) -> None:
    """Refuse a checkpoint whose files are cut short or garbled (a full disk, a copy that broke).

    Cheap structural checks, before the weights load and fail with a library's own words: JSON
    parses, safetensors headers cover their files, torch pickles have their zip index. A flipped
    bit inside tensor data is not detected.
    """
    folder = Path(checkpoint_dir)
    for path in sorted(folder.iterdir()):
        problem = _file_problem(path)
        if problem:
            earlier = _earlier_checkpoints(folder)
            hint = (f"resume from an earlier one ({earlier[-1]}) or delete this folder" if earlier
                    else "delete this folder and train without resuming")
            raise ValueError(f"Checkpoint {folder} is damaged: {path.name} {problem}. To go on, {hint}.")


def _file_problem(path: Path) -> str | None:
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "np"):
                pass
        elif path.suffix in (".pt", ".pth", ".bin"):
            zipfile.ZipFile(path).close()
    except Exception as err:  # noqa: BLE001 - JSON, zip, safetensors and OS errors alike
        return f"cannot be read ({type(err).__name__}: {err})"
    return None


def _earlier_checkpoints(folder: Path) -> list[str]:
    step = folder.name.split("-")[-1]
    if not step.isdigit():
        return []
    found = [p for p in folder.parent.glob("checkpoint-*")
             if p.name.split("-")[-1].isdigit() and int(p.name.split("-")[-1]) < int(step)
             and (p / ROLLOUT_STATE_NAME).is_file()]
    return [str(p) for p in sorted(found, key=lambda p: int(p.name.split("-")[-1]))]


class ResumeError(ValueError):
    """A checkpoint to resume from that is not there: refused before anything starts."""


def resume_checkpoint(value: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint folder a run resumes from (True: the newest complete one in `output_dir`),
    checked before a server starts or a model loads, so a first run that asks to resume fails in
    a second with what to do, not after the server's start-up."""
    if value is None or value is False:
        return None
    if value is True:
        last = last_complete_checkpoint(output_dir)
        if last is None:
            raise ResumeError(
                f"Cannot resume: {output_dir} has no complete checkpoint-N folder (one with "
                f"{ROLLOUT_STATE_NAME}). Train without resume_from_checkpoint the first time "
                "(a checkpoint is written every save_steps), or pass a checkpoint folder.")
        return str(last)
    folder = Path(value)
    if not folder.is_dir():
        raise ResumeError(f"Cannot resume: the checkpoint folder {folder} does not exist. Pass a "
                          f"checkpoint-N folder of an earlier run, or true for the newest in "
                          f"{output_dir}.")
    if not (folder / ROLLOUT_STATE_NAME).is_file():  # final/, or a checkpoint killed mid-save:
        # RolloutState.load refused it too, but only once the server and model were up
        last = last_complete_checkpoint(output_dir)
        raise ResumeError(
            f"Cannot resume from {folder}: it holds no {ROLLOUT_STATE_NAME}, so it is no complete "
            "checkpoint of an AsyncGRPOTrainer run (final/ and a checkpoint cut short by a kill "
            "have none). Pass a checkpoint-N folder"
            + (f", e.g. {last}, or true for the newest." if last else " of an earlier run."))
    return str(folder)


# How each entry point resumes from the newest checkpoint, for the advice a stopped run prints:
# `trainer.train` takes True (a text is a folder), the CLI's --set takes last (or true).
PYTHON_RESUME = "trainer.train(resume_from_checkpoint=True)"
CLI_RESUME = "--set resume_from_checkpoint=last"


def resume_advice(output_dir: str | Path | None, setting: str = PYTHON_RESUME) -> str:
    """How to go on after a run stopped: resume only where a checkpoint is there to resume from."""
    last = last_complete_checkpoint(output_dir) if output_dir is not None else None
    if last is None:
        return "run it again (no checkpoint was written yet to resume from)"
    return f"resume from {last.name} with {setting}"


def last_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint-N that holds rollout_state.json (one killed mid-save does not)."""
    folders = [p for p in Path(output_dir).glob("checkpoint-*")
               if p.name.split("-")[-1].isdigit() and (p / ROLLOUT_STATE_NAME).is_file()]
    return max(folders, key=lambda p: int(p.name.split("-")[-1]), default=None)


class PromptLedger:
    """Counts trained samples per prompt and tracks the first prompt not yet consumed."""

    def __init__(self, state: RolloutState | None = None) -> None:
        state = state or RolloutState()
        self.frontier = state.first_untrained_prompt_index
        self._consumed_ahead: set[int] = set(state.consumed_after_first)
        self._skip: frozenset[int] = frozenset(state.consumed_after_first)
        self._trained_counts: dict[int, int] = {}
        self._noticed_since_step: dict[int, str] = {}
        self._advance()

    def already_consumed(self, prompt_index: int) -> bool:
        """True for samples of a prompt consumed before the checkpoint we resumed from."""
        return prompt_index in self._skip

    def record_trained(self, samples: list[TrainingSample]) -> list[int]:
        """Count samples of one optimizer step; returns the prompts this step completed."""
        completed = []
        for sample in samples:
            count = self._trained_counts.get(sample.prompt_index, 0) + 1
            self._trained_counts[sample.prompt_index] = count
            if count >= sample.group_num_samples:
                completed.append(sample.prompt_index)
        for index in completed:
            self._consume(index)
        return completed

    def frontier_after(self, samples: list[TrainingSample]) -> int:
        """The frontier once `samples` (a step being filled) are trained; changes nothing."""
        counts: dict[int, int] = {}
        completed = set(self._consumed_ahead)
        for sample in samples:
            index = sample.prompt_index
            counts[index] = counts.get(index, self._trained_counts.get(index, 0)) + 1
            if counts[index] >= sample.group_num_samples:
                completed.add(index)
        frontier = self.frontier
        while frontier in completed:
            frontier += 1
        return frontier

    def record_consumed(self, notice: PromptConsumed) -> None:
        if self.already_consumed(notice.prompt_index):
            return  # consumed before the checkpoint we resumed from; regenerated, not retrained
        self._noticed_since_step[notice.prompt_index] = notice.reason
        self._consume(notice.prompt_index)

    def take_noticed(self) -> dict[int, str]:
        """Prompts consumed without samples since the last call, with why (for the ledger file)."""
        noticed, self._noticed_since_step = self._noticed_since_step, {}
        return noticed

    def state(self, model_version: int) -> RolloutState:
        return RolloutState(self.frontier, sorted(self._consumed_ahead), model_version)

    def _consume(self, index: int) -> None:
        self._trained_counts.pop(index, None)
        if index >= self.frontier:
            self._consumed_ahead.add(index)
        self._advance()

    def _advance(self) -> None:
        while self.frontier in self._consumed_ahead:
            self._consumed_ahead.remove(self.frontier)
            self.frontier += 1


def append_ledger_line(
    output_dir: str | Path, step: int, completed: list[int], noticed: dict[int, str], frontier: int
) -> None:
    """One JSON line per step: prompts it trained to completion, prompts the worker reported
    consumed without samples (`noticed`, and by reason in `reasons`: zero_std, stalled,
    server_lost, ...), and the resume point after it (the resume test reads these).
    `pid` tells runs apart: a resumed run may start right after the killed run's last step."""
    path = Path(output_dir) / LEDGER_NAME
    reasons: dict[str, list[int]] = {}
    for index, reason in sorted(noticed.items()):
        reasons.setdefault(reason, []).append(index)
    record = {"pid": os.getpid(), "step": step, "completed": sorted(completed), "noticed": sorted(noticed),
              "reasons": reasons, "frontier": frontier}
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
