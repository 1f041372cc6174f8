"""A damaged checkpoint is refused by name, and a full disk while saving leaves no checkpoint
that resume would take.

The files are the real formats a checkpoint holds (safetensors weights, torch pickles, JSON);
the disk is a real 64 KiB tmpfs when this process may mount one (root), else RLIMIT_FSIZE
(per file only, so the test then checks a file size limit, not a full disk).
"""
from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from grpo_agent.cli.failure import is_disk_full
from grpo_agent.train.checkpoint import RolloutState, check_checkpoint, last_complete_checkpoint
from safetensors.torch import save_file


def _checkpoint(output_dir: Path, step: int) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, folder / "model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.zeros(4096)}}}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    RolloutState(first_untrained_prompt_index=step * 8, model_version=step).save(folder)
    return folder


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("name, damage", [
    ("model.safetensors", _cut),
    ("optimizer.pt", _cut),
    ("rollout_state.json", lambda p: p.write_text('{"first_untrained_prompt_index": 1')),
    ("trainer_state.json", lambda p: p.write_bytes(b"\x00" * 64)),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_an_earlier_one(tmp_path, name, damage):
    earlier = _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 4)
    check_checkpoint(newest)  # intact
    damage(newest / name)
    with pytest.raises(ValueError, match=rf"checkpoint-4 is damaged: {name} cannot be read") as raised:
        RolloutState.load(newest)
    assert f"resume from an earlier one ({earlier})" in str(raised.value)
    assert RolloutState.load(earlier).first_untrained_prompt_index == 16


@contextlib.contextmanager
def _small_disk(tmp_path: Path, size_kib: int):
    """A real tmpfs of `size_kib` when mounting is allowed; else the folder and RLIMIT_FSIZE."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)],
        capture_output=True, check=False).returncode == 0
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    if not mounted:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size_kib * 1024, old[1]))
    try:
        yield mount
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], check=False)
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)


def test_a_full_disk_while_saving_leaves_no_checkpoint_resume_would_take(tmp_path):
    with _small_disk(tmp_path, 64) as disk:
        complete = _checkpoint(disk, 1)  # ~40 KiB: fits
        with pytest.raises(Exception) as raised:  # safetensors wraps the OSError in its own error
            _checkpoint(disk, 2)  # the weights no longer fit
        assert is_disk_full(raised.value), raised.value
        assert not (disk / "checkpoint-2" / "rollout_state.json").exists()
        assert last_complete_checkpoint(disk) == complete


def test_the_earlier_checkpoint_named_is_the_newest_complete_one_by_step_number(tmp_path):
    """checkpoint-10 sorts before checkpoint-9 as text; checkpoint-11 (cut short, no
    rollout_state.json) is no place to resume from."""
    _checkpoint(tmp_path, 9)
    ten = _checkpoint(tmp_path, 10)
    (tmp_path / "checkpoint-11").mkdir()
    (tmp_path / "checkpoint-11" / "trainer_state.json").write_text("{}")
    newest = _checkpoint(tmp_path, 12)
    _cut(newest / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint-12 is damaged") as raised:
        RolloutState.load(newest)
    assert str(raised.value).endswith(f"resume from an earlier one ({ten}) or delete this folder.")


def test_a_damaged_checkpoint_without_an_earlier_one_says_to_train_without_resuming(tmp_path):
    only = _checkpoint(tmp_path, 3)
    _cut(only / "optimizer.pt")
    with pytest.raises(ValueError, match="delete this folder and train without resuming"):
        check_checkpoint(only)


def test_a_cut_short_pytorch_bin_file_is_refused(tmp_path):
    folder = _checkpoint(tmp_path, 2)
    torch.save({"w": torch.zeros(4096)}, folder / "pytorch_model.bin")
    check_checkpoint(folder)
    _cut(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin cannot be read"):
        check_checkpoint(folder)


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),
    OSError(122, "Disk quota exceeded"),
    OSError(27, "File too large"),
])
def test_a_full_disk_is_recognised_by_errno_even_when_wrapped(error):
    """Writers wrap the OSError (a RuntimeError raised from it, or while handling it)."""
    error.strerror = "x"  # the errno alone must tell: no telling words in the message
    error.args = (error.errno, "x")
    try:
        try:
            raise error
        except OSError as cause:
            raise RuntimeError("saving the checkpoint failed") from cause
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    try:
        try:
            raise error
        except OSError:
            raise RuntimeError("cleanup after the failed save failed too")  # the OSError is its __context__
    except RuntimeError as chained:
        assert is_disk_full(chained)
    assert not is_disk_full(RuntimeError("boom", OSError(13, "Permission denied")))
