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
