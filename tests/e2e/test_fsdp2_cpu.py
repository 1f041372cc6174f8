"""FSDP2 on CPU with gloo: two trainer processes give one process's loss, gradients and metrics."""
import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fsdp_worker.py")
METRICS_WORKER = Path(__file__).with_name("fsdp_metrics_worker.py")


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


@pytest.mark.slow
def test_loss_metrics_are_reduced_over_every_process(torchrun, tmp_path):
    """Rank 0 logs sampling/* and entropy over both processes' trained tokens, not its own."""
    out = tmp_path / "metrics.json"
    torchrun(METRICS_WORKER, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["trained"] == [16, 32]
    expected, got = result["expected"], result["metrics"]
    assert 0 < expected["sampling/masked_mean"] < 1  # the masked fraction is not trivially 0/1
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert result["rank0_only"]["entropy"] != pytest.approx(expected["entropy"], rel=1e-6)
    assert result["rank0_only"]["sampling/sampling_logp_difference/mean"] != pytest.approx(
        expected["sampling/sampling_logp_difference/mean"], rel=1e-3)
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5, abs=1e-7)
