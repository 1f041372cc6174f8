"""Padded dense parts for `level_attention`: a level part as one [B, L, heads, dim] batch, run
by cuDNN's dense SDPA kernel.

Why: on an H200 cuDNN's dense causal attention ran 1.4-1.75x faster than torch's flash kernel
(bench/attention_kernels.py), while its ragged entry point is unusable on torch 2.11 (73 ms a
forward, a failing backward). A level part is a set of (query range, key range) pairs; when the
ranges are alike in length they pad into one dense batch with no mask at all:
- self parts (causal, the queries are the keys): right padding needs no mask, because with
  top-left causal alignment a real query i sees keys 0..i, all real. Segments are grouped by
  length (a segment joins a group while it has at least PAD_RATIO of the group's longest), so
  prompts and completions become separate calls and padding stays bounded;
- depth parts (not causal): only where every key range has one length (no key padding, so no
  mask) and the queries fill at least PAD_RATIO of the padded batch; otherwise the part stays
  on the varlen flash kernel.
Padded queries are zero in q, dout and lse, so in the backward P = exp(0 - 0) = 1 and
dP = D = 0: they add nothing to dK/dV and nothing NaN. Their outputs are dropped.

Measured on an H200 (docs/performance.md): the prompt part of group rows on cuDNN is worth
1.7-3.4% of the compiled 1.7B step; padding the self part too made attention 1.7-2.1x slower
(each part's gathers, masks and index adds cost more than the kernel saves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_agent.train.transfer import to_device

PAD_RATIO = 0.5
HEAD_DIMS = (64, 128)  # seen matching the reference on an H200 (probe, tests/train/test_gpu.py)


@dataclass
class DensePart:
    """One padded batch: where each padded slot reads from, and where real slots go back to."""

    q_index: torch.Tensor  # long [B, len_q]: row of each query slot (0 for padding)
    q_valid: torch.Tensor  # bool [B, len_q]
    k_index: torch.Tensor  # long [B, len_k]: row of each key slot (0 for padding)
    rows_q: torch.Tensor  # long: the real query rows ...
    pos_q: torch.Tensor  # ... and their slots
    rows_k: torch.Tensor  # long: the real key rows ...
    pos_k: torch.Tensor  # ... and their slots
    batch: int
    len_q: int
    len_k: int
    causal: bool

    @classmethod
    def build(cls, pairs: list[tuple[range, range]], causal: bool, device) -> DensePart:
        len_q = max(len(q) for q, _ in pairs)
        len_k = max(len(k) for _, k in pairs)
        if causal and any(len(q) != len(k) or q != k for q, k in pairs):
            raise ValueError("a causal dense part attends each segment to itself")
        q_index = torch.zeros(len(pairs), len_q, dtype=torch.long)
        q_valid = torch.zeros(len(pairs), len_q, dtype=torch.bool)
        k_index = torch.zeros(len(pairs), len_k, dtype=torch.long)
        k_valid = torch.zeros(len(pairs), len_k, dtype=torch.bool)
        for b, (q, k) in enumerate(pairs):
            q_index[b, : len(q)] = torch.arange(q.start, q.stop)
            q_valid[b, : len(q)] = True
            k_index[b, : len(k)] = torch.arange(k.start, k.stop)
            k_valid[b, : len(k)] = True
        # slots in the flattened [B * len] batch
        pos_q, pos_k = (m.flatten().nonzero().squeeze(1) for m in (q_valid, k_valid))
        tensors = to_device(device, q_index, q_valid, k_index, q_index.flatten()[pos_q], pos_q,
                            k_index.flatten()[pos_k], pos_k)
        return cls(*tensors, len(pairs), len_q, len_k, causal)


def self_parts(segments: list[range], device) -> list[DensePart]:
    """The self part (each segment causal on itself) as batches of segments of similar length."""
    groups: list[list[range]] = []
    for seg in sorted(segments, key=len, reverse=True):
        if groups and len(seg) >= PAD_RATIO * len(groups[-1][0]):
            groups[-1].append(seg)
        else:
            groups.append([seg])
    return [DensePart.build([(s, s) for s in group], True, device) for group in groups]


def depth_part(pairs: list[tuple[range, range]], device) -> DensePart | None:
    """A depth part as one batch, or None where it would need key padding or pad too much."""
    if len({len(k) for _, k in pairs}) != 1:
        return None
    len_q = max(len(q) for q, _ in pairs)
    if sum(len(q) for q, _ in pairs) < PAD_RATIO * len(pairs) * len_q:
        return None
    return DensePart.build(pairs, False, device)


def padded(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Rows of x [N, ...] into [B, L, ...] by index [B, L]; slots outside `valid` are zero.
    (The batch shape rides on the index tensors: ints 0/1 in a compiled autograd.Function's
    context broke tracing on torch 2.11.)"""
    out = x.index_select(0, index.flatten())
    if valid is not None:
        out = torch.where(valid.view(-1, *[1] * (x.dim() - 1)), out, 0)
    return out.view(*index.shape, *x.shape[1:])


# --- the cuDNN kernel: [B, L, heads, dim] in, (out [B, L, heads, dim], lse [B, L, heads] f32)


def cudnn_forward(q, k, v, causal: bool, scale: float):
    batch, len_q, heads, _ = q.shape
    k, v = (_expand(t, heads) for t in (k, v))
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False,
        scale=scale,
    )
    return out.transpose(1, 2), lse.reshape(batch, heads, len_q).transpose(1, 2)


def cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients from the given out and lse (the merged ones: see level_attention)."""
    heads_k = k.shape[2]
    kx, vx = (_expand(t, q.shape[2]) for t in (k, v))
    unused = torch.zeros((), dtype=torch.long, device=q.device)  # dropout 0: no random state
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), kx.transpose(1, 2), vx.transpose(1, 2),
        out.transpose(1, 2), lse.transpose(1, 2).unsqueeze(-1).contiguous(), unused, unused,
        None, None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale,
    )
    dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
    if dk.shape[2] != heads_k:
        dk, dv = (t.unflatten(2, (heads_k, -1)).sum(3) for t in (dk, dv))
    return dq, dk, dv


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated to the query heads where cuDNN is not trusted with GQA (see probe)."""
    if t.shape[2] == heads or native_gqa():
        return t
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def native_gqa() -> bool:
    """What the probe saw; False until it ran (the safe choice)."""
    return _PROBE.get("gqa", False)


_PROBE: dict[str, bool] = {}
PROBE_NOTES: list[str] = []  # what the probe saw, for benches and bug reports


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """cuDNN attention runs here and matches the flash kernel, forward and backward (probed once
    per process on a small GQA batch; a failing or wrong kernel leaves level parts on flash)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if "ok" not in _PROBE:
        # plans are also built for no-grad evaluation; the probe checks gradients
        with torch.inference_mode(False), torch.enable_grad():
            _PROBE.update(_probe(device, dtype))
    return _PROBE["ok"]


def _probe(device, dtype) -> dict[str, bool]:
    if not torch.backends.cudnn.is_available():
        return {"ok": False}
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 96, 4, 128, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(2, 96, 2, 128, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    dout = torch.randn_like(q)
    ref = _math_attention(q, k, v, dout)
    for gqa in (True, False):
        _PROBE["gqa"] = gqa
        try:
            out, lse = cudnn_forward(q, k, v, True, 0.1)
            grads = cudnn_backward(dout, q, k, v, out, lse, True, 0.1)
        except Exception as exc:  # noqa: BLE001 -- any failure: this form is not usable here
            PROBE_NOTES.append(f"gqa={gqa}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        errors = [_error(a, b) for a, b in zip((out, lse, *grads), ref)]
        PROBE_NOTES.append(f"gqa={gqa}: relative errors out, lse, dq, dk, dv {errors}")
        if all(e < 2e-2 for e in errors):
            return {"ok": True, "gqa": gqa}
    return {"ok": False, "gqa": False}


def _math_attention(q, k, v, dout):
    """float32 causal attention on [B, L, H, D] with its lse and gradients (the probe's oracle)."""
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, 2) for t in (kf, vf))
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kk) * 0.1
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)
    grads = torch.autograd.grad(out, (qf, kf, vf), dout.float())
    return (out, scores.logsumexp(-1).transpose(1, 2), *grads)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("inf")
