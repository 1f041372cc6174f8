"""A step whose gradient norm is NaN/inf is skipped, so a NaN never reaches the weights (nor,
at the next push, the vLLM server, which would then sample from NaN weights until restarted).

Design decision: transformers computes each step's gradient norm before `optimizer.step()`,
clipping or not. With a fused Adam/AdamW (the default `adamw_torch_fused`) the skip is the
optimizer's own `found_inf` input, the one torch's GradScaler sets: a flag on the device, so
the step adds no host wait; the flag is read at the step's read with the rest. Other
optimizers take no such input: their norm is read on the host before the step, and a bad one
drops the gradients (torch optimizers skip a parameter without one). Either way the Adam
moments and step counts stay as they were. A few skipped steps in a row mean the run cannot
take a finite step any more: it stops, naming the steps and the usual causes.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

MAX_SKIPPED_IN_A_ROW = 3


class NonFiniteGradientError(RuntimeError):
    """Every step of the last `MAX_SKIPPED_IN_A_ROW` had a NaN/inf gradient norm."""


class UpdateGuard:
    """Arms the skip before each optimizer step; `read` counts skips once the step has run."""

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None  # 1.0 where the armed step is skipped
        self._norm: torch.Tensor | None = None
        self._skipped_steps: list[int] = []

    def arm(self, optimizer, grad_norm) -> None:
        """Before `optimizer.step()`: have it skip the update if `grad_norm` is NaN/inf."""
        if grad_norm is None:
            self._flag = self._norm = None
            return
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        on_device = isinstance(norm, torch.Tensor)  # a float where the norm was read already
        norm = torch.as_tensor(norm).detach().reshape(())
        self._norm = norm
        self._flag = (~torch.isfinite(norm)).to(torch.float32)
        if on_device and _takes_found_inf(inner):
            inner.found_inf = self._flag
        elif self._flag.item():
            inner.zero_grad(set_to_none=True)

    def read(self, step: int) -> float:
        """1.0 if `step`'s update was skipped, else 0.0 (a host read of the flag)."""
        if self._flag is None or not self._flag.item():
            self._skipped_steps = []
            return 0.0
        self._skipped_steps.append(step)
        logger.warning("Step %d: the gradient norm is %s, so its update was skipped (the weights "
                       "keep the last finite step's).", step, self._norm.item())
        return 1.0

    def stop_if_stuck(self) -> None:
        """Raise `NonFiniteGradientError` after `MAX_SKIPPED_IN_A_ROW` skips in a row."""
        if len(self._skipped_steps) >= MAX_SKIPPED_IN_A_ROW:
            steps = ", ".join(map(str, self._skipped_steps))
            raise NonFiniteGradientError(
                f"The gradient norm was NaN/inf at steps {steps} in a row: their updates were "
                "skipped, so the weights (and the server's) are still the last finite step's, but "
                "the run can no longer take a step. Look at `loss` and `grad_norm` in the metrics "
                "before it (a learning rate too high for this model diverges first) and for a "
                "reward, advantage or loss term that gives NaN/inf; then resume from the last "
                "checkpoint with a lower learning_rate or the cause fixed.")


def _takes_found_inf(optimizer) -> bool:
    """Torch's fused Adam/AdamW skip their update on the device where `found_inf` is 1."""
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
            and bool(optimizer.defaults.get("fused")))
