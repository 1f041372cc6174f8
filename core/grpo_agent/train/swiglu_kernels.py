"""Triton kernels of `swiglu` (imported only where they run: CUDA with Triton).

One program per (token, block of BLOCK columns): it loads the block's gate and up values once,
in float32, and writes its share of h (forward) or of both gradient halves (backward).
"""

import triton
import triton.language as tl


@triton.jit
def forward_kernel(gu_ptr, h_ptr, width, stride_gu, stride_h, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + width + cols, mask=ok).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def backward_kernel(dh_ptr, gu_ptr, dgu_ptr, width, stride_dh, stride_gu, stride_dgu,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dh = tl.load(dh_ptr + row * stride_dh + cols, mask=ok).to(tl.float32)
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + width + cols, mask=ok).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dh * gate * sig
    out = dgu_ptr + row * stride_dgu + cols
    tl.store(out, d_gate.to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(out + width, d_up.to(dgu_ptr.dtype.element_ty), mask=ok)
