"""CUDA: a NaN gradient norm skips fused AdamW's update on the device (no host read before the
step), and a finite one trains, with the guard armed from a CUDA norm as the trainer arms it."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_agent.train.update_guard import UpdateGuard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_skips_a_nan_step_on_the_device(dtype):
    weight = torch.nn.Parameter(torch.ones(1024, device="cuda", dtype=dtype))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    guard = UpdateGuard()
    for step, grad in enumerate((math.nan, 1.0), start=1):
        weight.grad = torch.full_like(weight, grad)
        norm = torch.nn.utils.clip_grad_norm_([weight], 1.0)
        guard.arm(optimizer, norm)
        assert optimizer.found_inf.device == weight.device
        before = weight.detach().clone()
        optimizer.step()
        skipped = guard.read(step)
        assert skipped == (1.0 if step == 1 else 0.0)
        assert torch.equal(weight.detach(), before) == (step == 1)
    assert torch.isfinite(weight).all() and float(optimizer.state[weight]["step"]) == 1.0
