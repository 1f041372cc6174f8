"""FSDP2 on CPU with gloo: two trainer processes give one process's loss, gradients and
metrics, and adapter sync gathers the unsharded adapter. One torchrun runs every check
(fsdp_checks.py); each test reads its own check's result."""
import json
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("fsdp_checks.py")


@pytest.fixture(scope="module")
def fsdp_result(torchrun, tmp_path_factory):
    """`fsdp_result(check)`: what rank 0 wrote for `check`; the run's output if it wrote none."""
    out = tmp_path_factory.mktemp("fsdp")
    try:
        torchrun(CHECKS, str(out), timeout=600)
        failure = ""
    except AssertionError as error:  # a failing check fails its test (and the ones after it)
        failure = str(error)

    def read(check: str) -> dict:
        path = out / f"{check}.json"
        assert path.is_file(), f"the {check!r} check wrote no result:\n{failure}"
        return json.loads(path.read_text())

    return read


@pytest.mark.slow
def test_two_fsdp2_processes_match_one_process_and_push_full_weights(fsdp_result):
    result = fsdp_result("loss")
    assert result["world"] == 2 and result["sharded"] == "DTensor"
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5, abs=1e-7)
    assert result["max_grad"] > 1e-3  # the comparison is not between zero gradients
    assert result["max_grad_error"] < 1e-5 * max(1.0, result["max_grad"])
    assert result["pushed_names_match"]
    assert result["max_weight_error"] == 0.0


@pytest.mark.slow
def test_loss_metrics_are_reduced_over_every_process(fsdp_result):
    """Rank 0 logs sampling/* and entropy over both processes' trained tokens, not its own."""
    result = fsdp_result("metrics")
    assert result["world"] == 2 and result["trained"] == [16, 32]
    expected, got = result["expected"], result["metrics"]
    assert 0 < expected["sampling/masked_mean"] < 1  # the masked fraction is not trivially 0/1
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert result["rank0_only"]["entropy"] != pytest.approx(expected["entropy"], rel=1e-6)
    assert result["rank0_only"]["sampling/sampling_logp_difference/mean"] != pytest.approx(
        expected["sampling/sampling_logp_difference/mean"], rel=1e-3)
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_fsdp2_ranks_gather_the_full_adapter_and_agree_it_needs_a_push(fsdp_result):
    """Adapter sync under FSDP2: the gathered adapter is the unsharded one."""
    result = fsdp_result("lora")
    assert result["sharded"] == "DTensor"
    assert result["names_match"]
    assert result["max_error"] == 0.0
    assert result["needs_push_when_zero"] is False
    assert result["needs_push_when_trained"] is True


@pytest.mark.slow
def test_fsdp2_ranks_agree_on_the_start_push_of_an_edit_only_one_shard_holds(fsdp_result):
    """The start push rule compares each rank's own shards with their fingerprint at load:
    an edit only rank 1 holds makes rank 0 push too (they all-reduce), unchanged shards don't."""
    result = fsdp_result("start_push")
    assert result["sharded"] == "DTensor"
    assert result["push_when_unchanged"] is False
    assert result["push_when_edited_on_rank_1"] is True
