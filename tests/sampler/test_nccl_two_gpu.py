"""The `nccl` weight sync against vLLM's own NCCL receiving engine, on two GPUs.

Runs `bench/nccl_two_gpu.py` at a reduced depth: our `WeightPusher` (FSDP2 gather,
`NcclWeightSync`, vLLM's trainer engine and HTTP client) pushes a Qwen3-0.6B-shaped random bf16
model from GPU 0 into vLLM's `NCCLWeightTransferEngine` in a subprocess on GPU 1, three times
with new weights each time; the receiver's tensors must equal the trainer's bit for bit after
every push, and the receiver must hold the last version. Needs two GPUs and vLLM's weight
transfer modules (on a box without vLLM: `bench/build_vllm_carry.py` and PYTHONPATH, see the
bench's docstring).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "nccl_two_gpu.py"


def _has_vllm_engine() -> bool:
    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer.nccl_engine") is not None
    except ModuleNotFoundError:
        return False


# vLLM's import is slow: looked up only where two GPUs are there.
_TWO_GPUS = torch.cuda.device_count() >= 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not _TWO_GPUS, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(_TWO_GPUS and not _has_vllm_engine(),
                       reason="needs vLLM's weight-transfer modules"),
]


def test_push_lands_bit_for_bit_in_vllms_nccl_engine():
    result = subprocess.run(
        [sys.executable, str(BENCH), "--pushes", "3", "--layers", "4"],
        check=False, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rounds = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    summary = rounds[-1]
    assert summary["pushes"] == 3
    for pushed in rounds[:-1]:
        assert pushed["bit_equal"], pushed["mismatched"]
        assert pushed["num_bytes"] > 0
    assert summary["bit_equal"]
    assert summary["last_version"] == "3"
    # Every weight arrived: 4 layers of 11 tensors, the embedding (tied with the LM head), norm.
    assert summary["num_tensors"] == 4 * 11 + 2
