"""FSDP2 on CPU with gloo: two trainer processes give one process's loss and gradients."""
import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.mark.slow
def test_two_fsdp2_processes_match_one_process_and_push_full_weights(torchrun, tmp_path):
    out = tmp_path / "result.json"
    torchrun(WORKER, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["sharded"] == "DTensor"
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5, abs=1e-7)
    assert result["max_grad"] > 1e-3  # the comparison is not between zero gradients
    assert result["max_grad_error"] < 1e-5 * max(1.0, result["max_grad"])
    assert result["pushed_names_match"]
    assert result["max_weight_error"] == 0.0
