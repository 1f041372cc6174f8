"""Triton kernels of `fused_lm_head` (imported only where they run: CUDA with Triton).

Each program computes one [BT x BV] block of logits h . w in float32 registers and writes only
its epilogue: the softmax statistics (forward) or the softmax gradient (backward). Programs are
numbered in groups of GT token blocks, vocabulary blocks within a group, so the programs
running at one time read a few token blocks and a few weight blocks, which stay in L2 (the
hidden states of 16k tokens at hidden 2048 alone are larger than the H200's L2). With
`TMA`, `h` and `w` are tensor descriptors and the Hopper copy engine brings the tiles in
(out-of-range rows come back as zeros); else they are pointers and every load is masked.
"""

import triton
import triton.language as tl


@triton.jit
def _logits_block(h_ptr, w_ptr, T, V, D, stride_h, stride_w, pid_t, pid_v,
                  BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr):
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_v = pid_v * BV + tl.arange(0, BV)
    acc = tl.zeros((BT, BV), dtype=tl.float32)
    if TMA:
        for d in range(0, D, BD):
            h = h_ptr.load([pid_t * BT, d])
            w = w_ptr.load([pid_v * BV, d])
            acc = tl.dot(h, tl.trans(w), acc)
    else:
        offs_d = tl.arange(0, BD)
        h_ptrs = h_ptr + offs_t[:, None] * stride_h + offs_d[None, :]
        w_ptrs = w_ptr + offs_v[:, None] * stride_w + offs_d[None, :]
        for d in range(0, D, BD):
            d_ok = (offs_d + d) < D
            h = tl.load(h_ptrs, mask=(offs_t[:, None] < T) & d_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(offs_v[:, None] < V) & d_ok[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w), acc)
            h_ptrs += BD
            w_ptrs += BD
    return acc, offs_t, offs_v


@triton.jit
def _block_ids(T, V, BT: tl.constexpr, BV: tl.constexpr, GT: tl.constexpr):
    """(token block, vocabulary block) of this program, grouped GT token blocks at a time."""
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BT)
    in_group = GT * tl.cdiv(V, BV)
    first_t = (pid // in_group) * GT
    size = tl.minimum(n_t - first_t, GT)
    return first_t + (pid % in_group) % size, (pid % in_group) // size


@triton.jit
def stats_kernel(h_ptr, w_ptr, max_ptr, sum_ptr, sumz_ptr, T, V, D, stride_h, stride_w,
                 inv_temp, BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                 GT: tl.constexpr, TMA: tl.constexpr):
    pid_t, pid_v = _block_ids(T, V, BT, BV, GT)
    acc, offs_t, offs_v = _logits_block(h_ptr, w_ptr, T, V, D, stride_h, stride_w,
                                        pid_t, pid_v, BT, BV, BD, TMA)
    v_ok = offs_v < V
    z = tl.where(v_ok[None, :], acc * inv_temp, float("-inf"))
    m = tl.max(z, axis=1)
    e = tl.exp(z - m[:, None])
    s = tl.sum(e, axis=1)
    sz = tl.sum(tl.where(v_ok[None, :], e * z, 0.0), axis=1)
    out = pid_v * T + offs_t
    t_ok = offs_t < T
    tl.store(max_ptr + out, m, mask=t_ok)
    tl.store(sum_ptr + out, s, mask=t_ok)
    tl.store(sumz_ptr + out, sz, mask=t_ok)

@triton.jit
def grad_kernel(h_ptr, w_ptr, lse_ptr, scale_ptr, g_ptr, T, V, D, stride_h, stride_w,
                stride_g, inv_temp, BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                GT: tl.constexpr, TMA: tl.constexpr):
    pid_t, pid_v = _block_ids(T, V, BT, BV, GT)
    acc, offs_t, offs_v = _logits_block(h_ptr, w_ptr, T, V, D, stride_h, stride_w,
                                        pid_t, pid_v, BT, BV, BD, TMA)
    t_ok = offs_t < T
    lse = tl.load(lse_ptr + offs_t, mask=t_ok, other=0.0)
    scale = tl.load(scale_ptr + offs_t, mask=t_ok, other=0.0)
    g = tl.exp(acc * inv_temp - lse[:, None]) * scale[:, None]
    ptrs = g_ptr + offs_t[:, None] * stride_g + offs_v[None, :]
    tl.store(ptrs, g.to(g_ptr.dtype.element_ty), mask=t_ok[:, None] & (offs_v < V)[None, :])
