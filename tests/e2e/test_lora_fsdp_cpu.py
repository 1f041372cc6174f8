"""Adapter sync under FSDP2 on CPU (gloo): the gathered adapter is the unsharded one."""
import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fsdp_lora_worker.py")


@pytest.mark.slow
def test_fsdp2_ranks_gather_the_full_adapter_and_agree_it_needs_a_push(torchrun, tmp_path):
    out = tmp_path / "result.json"
    torchrun(WORKER, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["sharded"] == "DTensor"
    assert result["names_match"]
    assert result["max_error"] == 0.0
    assert result["needs_push_when_zero"] is False
    assert result["needs_push_when_trained"] is True
