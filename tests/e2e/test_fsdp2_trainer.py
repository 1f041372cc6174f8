"""AsyncGRPOTrainer itself under torchrun: 2 FSDP2 processes (gloo, CPU), a real vLLM server,
a checkpoint of full (unsharded) tensors, and a resume from it."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

SCRIPT = Path(__file__).with_name("fsdp_trainer_script.py")
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]


def final_steps(out: Path) -> list[str]:
    return [(out / f"done-rank{rank}").read_text() for rank in (0, 1)]


def test_two_process_trainer_saves_full_checkpoints_and_resumes(
    torchrun, private_server, tiny_model_path, tmp_path
):
    out = tmp_path / "run"
    logs = torchrun(SCRIPT, str(tiny_model_path), private_server.base_url, str(out), "3")
    assert final_steps(out) == ["3", "3"]
    assert logs.count("{'loss'") == 3, "only the main process logs, once per step"

    checkpoint = out / "checkpoint-2"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    full = {name: tuple(p.shape) for name, p in model.named_parameters()}
    saved = load_file(checkpoint / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in saved.items()} == full  # gathered, not rank 0's shard
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]
    assert {k: tuple(v["exp_avg"].shape) for k, v in optimizer.items()} == full
    assert len(list(checkpoint.glob("rng_state_*.pth"))) == 2

    torchrun(SCRIPT, str(tiny_model_path), private_server.base_url, str(out), "5", "resume")
    assert final_steps(out) == ["5", "5"]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    ledger = [json.loads(line) for line in (out / "prompt_ledger.jsonl").read_text().splitlines()]
    resumed = [r for r in ledger if r["pid"] != ledger[0]["pid"]]
    assert [r["step"] for r in resumed] == [4, 5]  # the final save of the first run: checkpoint-3
