"""FSDP2 on CPU with gloo: two trainer processes give one process's loss and gradients."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.mark.slow
def test_two_fsdp2_processes_match_one_process_and_push_full_weights(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", str(WORKER), str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["sharded"] == "DTensor"
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5, abs=1e-7)
    assert result["max_grad"] > 1e-3  # the comparison is not between zero gradients
    assert result["max_grad_error"] < 1e-5 * max(1.0, result["max_grad"])
    assert result["pushed_names_match"]
    assert result["max_weight_error"] == 0.0
