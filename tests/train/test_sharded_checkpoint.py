"""ShardedCheckpointMixin on one CPU process: with one process it defers to the Trainer's own
save/load; with several (`fsdp.world_size` is the faked seam) it gathers full tensors, lets
only the saving rank write, and resumes from the files an unsharded run writes. The gathers
run for real: on an unsharded module they need no process group."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from grpo_agent.train import fsdp
from grpo_agent.train.sharded_checkpoint import ShardedCheckpointMixin
from safetensors.torch import save_file
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME


class _TrainerBase:
    """What the mixin calls on `transformers.Trainer`: its own paths, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def save_model(self, output_dir=None, _internal_call=False):
        self.calls.append(("save_model", output_dir, _internal_call))

    def _save_optimizer_and_scheduler(self, output_dir):
        self.calls.append(("_save_optimizer_and_scheduler", output_dir))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        self.calls.append(("_load_from_checkpoint", resume_from_checkpoint, model))

    def _load_optimizer_and_scheduler(self, checkpoint):
        self.calls.append(("_load_optimizer_and_scheduler", checkpoint))

    def _save(self, output_dir, state_dict=None):
        self.calls.append(("_save", output_dir, sorted(state_dict)))


class _Trainer(ShardedCheckpointMixin, _TrainerBase):
    def __init__(self, tmp_path, should_save=True):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1)
        self.args = SimpleNamespace(output_dir=str(tmp_path / "out"), should_save=should_save)

    def step(self):
        self.model(torch.ones(1, 3)).sum().backward()
        self.optimizer.step()
        self.lr_scheduler.step()


def test_one_process_uses_the_trainers_own_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(fsdp, "world_size", lambda: 1)
    trainer = _Trainer(tmp_path)
    trainer.save_model("a", True)
    trainer._save_optimizer_and_scheduler("b")
    trainer._load_from_checkpoint("c", "m")
    trainer._load_optimizer_and_scheduler("d")
    assert trainer.calls == [("save_model", "a", True), ("_save_optimizer_and_scheduler", "b"),
                             ("_load_from_checkpoint", "c", "m"),
                             ("_load_optimizer_and_scheduler", "d")]


def test_several_processes_gather_and_only_the_saving_rank_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(fsdp, "world_size", lambda: 2)
    gathered = []
    model_state, optimizer_state = fsdp.full_model_state, fsdp.full_optimizer_state
    monkeypatch.setattr(fsdp, "full_model_state",
                        lambda model: gathered.append("model") or model_state(model))
    monkeypatch.setattr(fsdp, "full_optimizer_state",
                        lambda *a: gathered.append("optimizer") or optimizer_state(*a))
    other = _Trainer(tmp_path, should_save=False)
    other.step()
    other.save_model()
    other._save_optimizer_and_scheduler(str(tmp_path))
    assert other.calls == [] and gathered == ["model", "optimizer"]  # joined the gathers only
    assert not (tmp_path / OPTIMIZER_NAME).exists()
    main = _Trainer(tmp_path)
    main.save_model()
    main.save_model(str(tmp_path / "final"))
    names = ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert main.calls == [("_save", str(tmp_path / "out"), names),
                          ("_save", str(tmp_path / "final"), names)]


def test_a_resume_loads_the_written_model_optimizer_and_scheduler(tmp_path, monkeypatch):
    monkeypatch.setattr(fsdp, "world_size", lambda: 2)
    saved = _Trainer(tmp_path)
    saved.step()
    saved.step()
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    state = fsdp.full_model_state(saved.model)
    save_file({k: state[k] for k in ("0.weight", "0.bias")}, checkpoint / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in ("1.weight", "1.bias")}, checkpoint / "model-00002-of-00002.safetensors")
    saved._save_optimizer_and_scheduler(str(checkpoint))
    assert {OPTIMIZER_NAME, SCHEDULER_NAME} <= {p.name for p in checkpoint.iterdir()}

    resumed = _Trainer(tmp_path)
    resumed._load_from_checkpoint(str(checkpoint))
    resumed._load_optimizer_and_scheduler(str(checkpoint))
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, saved.model.state_dict()[name], msg=name)
    assert resumed.lr_scheduler.state_dict() == saved.lr_scheduler.state_dict()
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 2
    torch.testing.assert_close(resumed.optimizer.state_dict()["state"][0]["exp_avg"],
                               saved.optimizer.state_dict()["state"][0]["exp_avg"])
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    resumed._load_from_checkpoint(str(checkpoint), other)  # the model the Trainer passes
    torch.testing.assert_close(other[1].weight, saved.model[1].weight)
    assert resumed.calls == []
    resumed._load_optimizer_and_scheduler(None)  # no checkpoint: the Trainer's own path
    assert resumed.calls == [("_load_optimizer_and_scheduler", None)]


def test_a_folder_without_model_weights_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(fsdp, "world_size", lambda: 2)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no model\\*.safetensors"):
        _Trainer(tmp_path)._load_from_checkpoint(str(tmp_path))
