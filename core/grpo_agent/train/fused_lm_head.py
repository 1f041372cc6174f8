"""The LM head's log-sum-exp and entropy as fused Triton kernels (CUDA), chunked over the vocab.

Design decision: the torch path (`logprobs._TiledLogSumExp`) writes every [tokens x tile] block
of logits from cuBLAS and reads it back for the softmax statistics, twice (forward, and the
recomputation in backward). Here the statistics are the matmul's epilogue: each program
computes one [tokens x vocabulary] block of logits in registers and writes only three numbers
per token (max, sum exp, sum exp * z) for that vocabulary block; `combine_blocks` merges them
into the log-sum-exp and the entropy. The backward recomputes each block the same way and
writes the softmax gradient (softmax * incoming gradient / T) in the compute dtype for one
vocabulary chunk at a time; the two gradient matmuls of that chunk stay in cuBLAS. No
[tokens x vocab] tensor exists at any point, and no raw logits are ever written.

`block_partials` / `chunk_softmax_grad` are the same arithmetic in torch: the CPU reference the
tests hold the kernels to, and stand in for them to test `FusedLogSumExp` on CPU. Where the
kernels cannot run (no CUDA, no Triton: imported lazily, so CPU CI never loads it) and under
sampling masks (`candidates`), the LM head takes the torch tiles (`logprobs._TiledLogSumExp`).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

# Block shape, token blocks per program group, launch options of both kernels, and whether
# tiles come by TMA (tensor descriptors) where the GPU has it (compute capability 9+) (the
# bench sweeps them: bench/lm_head.py --configs). TMA: the LM head's forward+backward 0.91x
# of pointer loads, the 1.7B step 0.991x, on an H100 (docs/performance.md).
CONFIG = {"BT": 128, "BV": 256, "BD": 64, "GT": 16, "num_warps": 8, "num_stages": 4,
          "TMA": True}


def block_partials(hidden, weight, temperature: float, block_v: int = 128):
    """[n_blocks, T] (max z, sum exp(z - max), sum exp(z - max) * z) per vocabulary block of
    `block_v` ids, z = h.w / T in float32: what the forward kernel writes (torch reference)."""
    maxes, sums, sums_z = [], [], []
    wide = torch.promote_types(hidden.dtype, torch.float32)
    for start in range(0, weight.shape[0], block_v):
        z = (hidden.to(wide) @ weight[start:start + block_v].to(wide).T) / temperature
        m = z.amax(dim=1)
        e = torch.exp(z - m[:, None])
        maxes.append(m), sums.append(e.sum(1)), sums_z.append((e * z).sum(1))
    return torch.stack(maxes), torch.stack(sums), torch.stack(sums_z)


def combine_blocks(maxes, sums, sums_z):
    """(lse [T], entropy [T]) from per-block partials [n_blocks, T]; blocks with no ids
    (max -inf, sums 0) add nothing."""
    run_max = maxes.amax(dim=0)
    safe_max = torch.where(torch.isfinite(run_max), run_max, torch.zeros_like(run_max))
    rescale = torch.exp(maxes - safe_max)
    total = (sums * rescale).sum(dim=0)
    lse = safe_max + torch.log(total)
    entropy = lse - (sums_z * rescale).sum(dim=0) / total
    return lse, entropy


def chunk_softmax_grad(hidden, weight_chunk, temperature: float, lse, scale):
    """softmax(z) * scale over one vocabulary chunk, in the compute dtype: what the backward
    kernel writes (torch reference); `scale` is the incoming gradient divided by T."""
    wide = torch.promote_types(hidden.dtype, torch.float32)
    z = (hidden.to(wide) @ weight_chunk.to(wide).T) / temperature
    return (torch.exp(z - lse[:, None]) * scale[:, None]).to(hidden.dtype)


@functools.cache
def _kernels():
    """Triton and the kernels, imported at the first CUDA call (never on import)."""
    import triton

    from grpo_agent.train import fused_lm_head_kernels as k

    return triton, k.stats_kernel, k.grad_kernel


def _grid(triton, tokens: int, vocab: int):
    return (triton.cdiv(tokens, CONFIG["BT"]) * triton.cdiv(vocab, CONFIG["BV"]),)


def _tma_ready(t: torch.Tensor) -> bool:
    """TMA (compute capability 9+) reads rows whose start and stride are 16-byte aligned."""
    return (torch.cuda.get_device_capability(t.device)[0] >= 9 and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0)


@functools.cache
def _tensor_descriptor():
    """Triton's host-side TMA descriptor class, or None where this Triton has none (torch
    2.6's Triton 3.2)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError as exc:
        log.info("this Triton has no tensor descriptors (%s): the LM head loads by pointer",
                 str(exc))  # text: see varlen_attention.load_hub_kernel
        return None
    return TensorDescriptor


def _operands(hidden, weight, config: dict) -> tuple[tuple, dict]:
    """(hidden, weight) as the kernels read them, and the config to launch with: tensor
    descriptors where `config["TMA"]` asks and Triton, the GPU and both tensors allow, else
    the tensors (pointers) and TMA off."""
    descriptor = _tensor_descriptor() if config.get("TMA") else None
    if descriptor is not None and _tma_ready(hidden) and _tma_ready(weight):
        return ((descriptor.from_tensor(hidden, [config["BT"], config["BD"]]),
                 descriptor.from_tensor(weight, [config["BV"], config["BD"]])), config)
    return (hidden, weight), {**config, "TMA": False}


def triton_partials(hidden, weight, temperature: float):
    """`block_partials` by the fused kernel: the logits never leave the registers."""
    triton, stats_kernel, _ = _kernels()
    tokens, vocab = hidden.shape[0], weight.shape[0]
    n_blocks = triton.cdiv(vocab, CONFIG["BV"])
    maxes, sums, sums_z = (torch.empty(n_blocks, tokens, device=hidden.device,
                                       dtype=torch.float32) for _ in range(3))
    (h, w), config = _operands(hidden, weight, CONFIG)
    stats_kernel[_grid(triton, tokens, vocab)](
        h, w, maxes, sums, sums_z, tokens, vocab, hidden.shape[1], hidden.stride(0),
        weight.stride(0), 1.0 / temperature, **config,
    )
    return maxes, sums, sums_z


def triton_softmax_grad(hidden, weight_chunk, temperature: float, lse, scale, out):
    """`chunk_softmax_grad` by the fused kernel, written into `out` ([T, chunk], hidden's
    dtype)."""
    triton, _, grad_kernel = _kernels()
    tokens, width = hidden.shape[0], weight_chunk.shape[0]
    (h, w), config = _operands(hidden, weight_chunk, CONFIG)
    grad_kernel[_grid(triton, tokens, width)](
        h, w, lse, scale, out, tokens, width, hidden.shape[1], hidden.stride(0),
        weight_chunk.stride(0), out.stride(0), 1.0 / temperature, **config,
    )
    return out


FLOAT32_ADDMM = True  # add a @ b into the float32 gradient inside the matmul (cuBLAS epilogue)


def _accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (float32) += a @ b (compute dtype), in float32: one matmul whose epilogue adds into
    acc where torch has `addmm(..., out_dtype=float32)`, else a matmul and an add."""
    global FLOAT32_ADDMM
    if FLOAT32_ADDMM:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            log.info("addmm with a float32 output is not available here (%s)",
                     str(exc))  # text: see varlen_attention.load_hub_kernel
            FLOAT32_ADDMM = False
    acc.add_(a @ b)


class FusedLogSumExp(torch.autograd.Function):
    """lse_t = logsumexp_v(h_t . w_v / T) and the entropy, with the Triton kernels above."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature, chunk):
        hidden, weight = hidden.contiguous(), weight.contiguous()
        lse, entropy = combine_blocks(*triton_partials(hidden, weight, temperature))
        ctx.save_for_backward(hidden, weight, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return lse, entropy

    @staticmethod
    def backward(ctx, grad_lse, _grad_entropy):
        hidden, weight, lse = ctx.saved_tensors
        scale = (grad_lse.float() / ctx.temperature).contiguous()
        vocab, chunk = weight.shape[0], ctx.chunk
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        buffer = torch.empty(hidden.shape[0], min(chunk, vocab), device=hidden.device,
                             dtype=hidden.dtype)
        for start in range(0, vocab, chunk):
            stop = min(start + chunk, vocab)
            w = weight[start:stop]
            g = triton_softmax_grad(hidden, w, ctx.temperature, lse, scale,
                                    buffer[:, : stop - start])
            _accumulate_matmul(grad_hidden, g, w)
            if grad_weight is not None:
                torch.mm(g.T, hidden, out=grad_weight[start:stop])
        return grad_hidden.to(hidden.dtype), grad_weight, None, None


def usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernels can run these tensors: CUDA, half precision, at least one
    token, Triton present."""
    if hidden.device.type != "cuda" or hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    if hidden.shape[0] == 0:  # an empty launch grid: nothing to fuse
        return False
    if weight.dtype != hidden.dtype:
        return False
    return triton_available()


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- absent or broken: the torch path is correct
        log.info("no Triton (%s): the LM head runs the torch tiles",
                 str(exc))  # text: see varlen_attention.load_hub_kernel
        return False
    return True
