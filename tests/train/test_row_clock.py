"""RowClock sums each row's forward and forward+backward time and starts over once read."""

from __future__ import annotations

import time

import pytest
import torch
from grpo_agent.train.row_clock import RowClock


def _row(clock: RowClock, forward_s: float, backward_s: float) -> None:
    clock.start_row()
    time.sleep(forward_s)
    clock.forward_done()
    time.sleep(backward_s)
    clock.end_row()


def test_cpu_clock_sums_rows_and_resets():
    clock = RowClock("cpu")
    _row(clock, 0.02, 0.03)
    _row(clock, 0.01, 0.0)
    got = clock.read()
    assert 0.03 <= got["fwd"] < got["fwd_bwd"]
    assert 0.06 <= got["fwd_bwd"] < 0.5
    assert clock.read() == {"fwd": 0.0, "fwd_bwd": 0.0}


def test_a_row_that_did_not_finish_is_left_out():
    clock = RowClock("cpu")
    clock.start_row()  # its loss raised: no forward_done / end_row
    _row(clock, 0.0, 0.01)
    assert 0.01 <= clock.read()["fwd_bwd"] < 0.5


def test_a_row_whose_backward_did_not_finish_is_left_out():
    clock = RowClock("cpu")
    clock.start_row()
    time.sleep(0.05)
    clock.forward_done()  # its backward raised: no end_row
    _row(clock, 0.0, 0.0)
    got = clock.read()
    assert got["fwd"] < 0.04 and got["fwd_bwd"] < 0.04


def test_a_replayed_row_counts_in_fwd_bwd_only():
    clock = RowClock("cpu")
    clock.start_row()
    time.sleep(0.02)
    clock.forward_unseen()  # forward and backward replayed as one graph
    clock.end_row()
    got = clock.read()
    assert got["fwd"] is None and 0.02 <= got["fwd_bwd"] < 0.5
    _row(clock, 0.01, 0.01)
    clock.start_row()
    clock.forward_unseen()
    clock.end_row()
    got = clock.read()
    assert 0.01 <= got["fwd"] < got["fwd_bwd"]  # the eager row's forward alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_clock_measures_device_time_not_queueing():
    clock = RowClock("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    a @ a  # cuBLAS's first call sets up its handle on the host (26 ms once, an H100 run)
    torch.cuda.synchronize()
    started = time.perf_counter()
    clock.start_row()
    for _ in range(20):  # ~50 ms of fp32 matmuls, queued in well under a millisecond
        a = a @ a / 64
    clock.forward_done()
    clock.end_row()
    queueing_s = time.perf_counter() - started
    got = clock.read()  # waits for the matmuls
    assert got["fwd"] > 5 * queueing_s
    assert got["fwd"] == pytest.approx(got["fwd_bwd"], abs=1e-3)
