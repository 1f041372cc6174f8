"""Kernels for Gated DeltaNet layers on tree-packed rows: path convolution and tree delta rule.

Design decision: both kernels take the trie's structure as plain index tensors built once per
row (`gated_deltanet.DeltaPlan`), so they know nothing about tries, and both are written for
few, large kernels: in eager mode a GPU step of a hybrid is bound by the host queueing kernels,
not by arithmetic (a 2B hybrid queued ~1300 small kernels per Gated DeltaNet layer before).
- `path_conv`: the depthwise causal convolution where tap j of token i reads the token j steps
  before it *along its own sample*. Segments are contiguous in the row, so the ordinary causal
  convolution over the row (the unpacked path's own `conv1d`) is already right for every token
  at least K-1 tokens into its segment; only the first K-1 tokens of each segment read across
  a segment boundary, and those few rows are recomputed from an index table of their true
  predecessors (a missing predecessor reads zero) and written over the convolution's rows.
- `tree_chunk_delta_rule`: the chunked gated delta rule over all segments of the row at once.
  Each segment is cut into chunks (`chunk_size`; its last chunk padded: zero keys, beta 0
  and decay 0 leave the state unchanged, so padding is exact), and every chunk's within-chunk
  work (the WY system and its triangular solve, the causal scores) runs batched over all
  chunks of the row. What is left is linear in the state: a chunk maps the state S it starts
  from to A S + B (A = e^{decay} I - K_w^T W, B = K_w^T U), so the only sequential part is
  one batched matmul per *step*, where step t holds every chunk that is t chunks from its root
  along its trie path: its predecessor (the previous chunk of its segment, or its parent
  segment's last chunk; siblings share it; roots start from zero) is in step t-1. Outputs are
  then one batched read of each chunk's start state. Forward and backward are those of each
  sample run alone (float32 throughout, as transformers' torch rule).
  On CUDA flash-linear-attention's varlen `chunk_gated_delta_rule` (per-segment initial
  states, depth by depth) runs instead when importable and safe.
The recurrence, per head with state S [Dk, Dv]: S <- exp(g_t) S; S <- S + beta_t k_t (v_t -
S^T k_t)^T; o_t = S^T q_t, with q, k L2-normalised and q scaled by Dk^-1/2.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

# Tokens per chunk of the torch tree rule: the sequential part is one step per chunk along the
# longest path, so on a GPU, where eager steps are bound by queueing kernels, longer chunks
# (fewer steps) win; on CPU the within-chunk work, which grows with the chunk, is what costs,
# and 64 (transformers' size) is faster. The result is the same either way.
CHUNK = 64
CHUNK_CUDA = 128


def chunk_size(device: torch.device) -> int:
    return CHUNK_CUDA if device.type == "cuda" else CHUNK


def path_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              fix_rows: torch.Tensor, fix_taps: torch.Tensor, fix_valid: torch.Tensor
              ) -> torch.Tensor:
    """Causal depthwise convolution along trie paths: x [C, N] -> [C, N] (weight's dtype).

    `fix_rows` [M]: the tokens fewer than K-1 tokens into their segment; `fix_taps` [M*K] the
    token each of their taps reads, oldest first, and `fix_valid` [M*K, 1] 0 where there is
    none (that tap reads zero)."""
    channels, n = x.shape
    kernel = weight.shape[-1]
    x = x.to(weight.dtype)
    out = torch.nn.functional.conv1d(x[None], weight[:, None], bias, padding=kernel - 1,
                                     groups=channels)[0, :, :n]
    if fix_rows.numel() == 0:
        return out
    # The boundary rows, summed in float32 (as cuDNN's half-precision convolution accumulates).
    work = torch.promote_types(weight.dtype, torch.float32)
    taps = x.t().index_select(0, fix_taps).to(work) * fix_valid  # [M*K, C]
    fixed = (taps.view(-1, kernel, channels) * weight.t().to(work)).sum(1)
    if bias is not None:
        fixed = fixed + bias.to(work)
    return out.index_copy(1, fix_rows, fixed.t().to(out.dtype))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def tree_chunk_delta_rule(q, k, v, g, beta, slots, num_chunks, step_sizes, step_preds,
                          use_qk_l2norm: bool, chunk: int):
    """The gated delta rule along trie paths, in torch. q, k [N, H, Dk], v [N, H, Dv], g, beta
    [N, H] (any float dtypes); `slots` [N]: each token's row in the chunk layout
    [num_chunks * chunk], chunks ordered by step; `step_sizes`: chunks per step;
    `step_preds[t]` (t >= 1): each chunk's predecessor among step t-1's chunks (None: the
    i-th chunk of step t follows the i-th of step t-1). Returns [N, H, Dv] in float32."""
    _, heads, dk = k.shape
    dv = v.shape[-1]
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * dk ** -0.5
    x = torch.cat([q, k, v.float(), g.float()[..., None], beta.float()[..., None]], -1)
    width = x.shape[-1]
    x = x.new_zeros(num_chunks * chunk, heads, width).index_copy(0, slots, x)
    x = x.view(num_chunks, chunk, heads, width).transpose(1, 2)  # [C, H, L, width]
    q, k, v = x[..., :dk], x[..., dk:2 * dk], x[..., 2 * dk:2 * dk + dv]
    g, beta = x[..., -2], x[..., -1]  # [C, H, L]
    decay = g.cumsum(-1)  # log decay from the chunk's start up to and including t
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    grow = decay.exp()[..., None]
    # WY form: (I + strictly-lower(beta_i k_i.k_j decay_ij)) [u | w] = [beta v | beta k e^decay]
    system = (k_beta @ k.transpose(-1, -2)) * pair
    rhs = torch.cat([v * beta[..., None], k_beta * grow], -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * pair  # causal scores within the chunk, diagonal included
    # The chunk's effect: end state = A S + B with S its start state; output = M S + P.
    last = decay[..., -1:]
    k_write = k * (last - decay).exp()[..., None]
    write = k_write.transpose(-1, -2) @ solved  # [C, H, Dk, Dv + Dk] = [B | K_w^T W]
    eye = torch.eye(dk, dtype=x.dtype, device=x.device)
    a = last.exp()[..., None] * eye - write[..., dv:]
    b = write[..., :dv]
    read = inner @ solved  # [inner U | inner W]
    m = q * grow - read[..., dv:]
    p = read[..., :dv]
    # the only sequential part: one batched matmul per step along the trie
    a_steps, b_steps = a.split(step_sizes), b.split(step_sizes)
    starts = [x.new_zeros(step_sizes[0], heads, dk, dv)]
    state = b_steps[0]
    for t in range(1, len(step_sizes)):
        prev = state if step_preds[t] is None else state.index_select(0, step_preds[t])
        starts.append(prev)
        state = torch.baddbmm(b_steps[t].flatten(0, 1), a_steps[t].flatten(0, 1),
                              prev.flatten(0, 1)).view_as(prev)
    start = torch.cat(starts) if len(starts) > 1 else starts[0]
    out = m @ start + p  # [C, H, L, Dv]
    out = out.transpose(1, 2).reshape(num_chunks * chunk, heads, dv)
    return out.index_select(0, slots)


@functools.cache
def fla_chunk_rule():
    """flash-linear-attention's varlen chunk kernel, or None (not installed, or no CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as error:  # noqa: BLE001 - any import failure means "use torch"
        logger.info("flash-linear-attention not importable (%s): torch delta rule.",
                    str(error))  # text: see varlen_attention.load_hub_kernel
        return None
    problem = _fla_backward_problem()
    if problem:
        logger.warning("flash-linear-attention present but %s: torch delta rule.", problem)
        return None
    return chunk_gated_delta_rule


def _fla_backward_problem() -> str | None:
    """fla 0.6 refuses its gated backward on Hopper with Triton >= 3.4, < 3.7.1 (wrong results,
    fla issue #640) unless tilelang is installed; it raises only in the backward, so check
    before the first step instead of failing mid-training."""
    import importlib.util

    import triton

    if torch.cuda.get_device_capability()[0] != 9 or importlib.util.find_spec("tilelang"):
        return None
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3])
    if (3, 4, 0) <= version < (3, 7, 1):
        return f"Triton {triton.__version__} on Hopper miscomputes its backward (fla #640)"
    return None


@functools.cache
def announce(kernel: str) -> None:
    """One log line per process saying which Gated DeltaNet kernel runs."""
    logger.warning("Gated DeltaNet tree packing: %s chunked delta rule, torch path convolution.",
                   kernel)
