"""`cuda_graphs=True`: the trainer's rows replayed through `row_graphs`, with its own loss.

Design decision: where the host queueing kernels sets the pace (short rows, fast GPUs), one
graph replay per row removes that bound. The graph holds the decoder, the LM head,
`loss.policy_loss` over the bucket's padded entries (advantage 0 at padding) and the
backward; the loss metrics are computed after the replay from the graph's outputs by
`loss.loss_metrics`, so the eager and the graphed row share every rule. Rows a graph cannot
take (nothing trained, sampler candidate sets, GRAPH_MAX_TOKENS or more) run eagerly. What
cannot be captured is refused when the trainer is built, naming the fix: several processes
(FSDP's collectives), float32 or non-flash attention, Gated DeltaNet, sliding-window and MoE
layers (here), gradient checkpointing or fp16's loss scaler (`AsyncGRPOConfig`). Each new row
shape costs one warm-up and one capture (about two more row steps). Off by default: on an
H100 the trainer's 8k-token step is mostly GPU-bound (a replay 6-11% faster than the eager row
on FlashAttention 4's masked path with 2 GiB more memory, 3% slower on torch's varlen kernels:
docs/performance.md).
"""
from __future__ import annotations

import logging

import torch

from grpo_agent.train import fsdp, row_graphs, varlen_attention
from grpo_agent.train.forward import is_moe
from grpo_agent.train.loss import (
    LossConfig,
    LossInputs,
    dense_token_samples,
    loss_metrics,
    padded_policy_loss,
)
from grpo_agent.train.packing import PackedRow
from grpo_agent.train.transfer import to_device
from grpo_agent.train.tree_attention import LEVELS_MIN_TOKENS

logger = logging.getLogger(__name__)

# Rows this long or longer run eagerly: the GPU sets their pace (no host bound to remove), and
# on an H100 the graph pool of 1.7B-shape 16k-token rows (34 GiB, growing with each new level
# shape) did not fit beside the eager step and the optimizer. Below it, rows take the path the
# eager trainer's "auto" gives them short of levels (`tree_attention.LEVELS_MIN_TOKENS`):
# masked where FlashAttention 4 runs, from `tree_attention.MASKED_MIN_TOKENS`, else varlen.
GRAPH_MAX_TOKENS = LEVELS_MIN_TOKENS

# Bucket granularity in training (`row_graphs.STEPS` is the benches' finer one): rows fill up
# to the token budget but every other size varies from step to step, and each new shape costs
# one warm-up and one capture, so sizes are rounded coarsely; the padding is cheap (at most
# 511 tokens through the layers, 255 LM-head entries, padding keys seen by padding only).
TRAINER_STEPS = {"tokens": 512, "segments": 64, "keys": 2048, "trained": 256, "seqlen": 1024,
                 "rows": 256}


def check_model(model) -> None:
    """Refuse a model or process layout the graphs cannot capture, naming the fix."""
    if fsdp.world_size() > 1:
        raise ValueError("cuda_graphs=True runs in one process only (FSDP's collectives are not "
                         "captured): launch one process or turn cuda_graphs off.")
    if is_moe(model):
        raise ValueError("cuda_graphs=True cannot capture MoE layers (their routing decides "
                         "shapes on the GPU): turn cuda_graphs off for this model.")
    _check_device(model)


def _check_device(model) -> None:
    """What varlen rows need (every graphed row can take varlen): CUDA, half precision, flash."""
    param = next(model.parameters())
    if (param.device.type != "cuda" or param.dtype not in varlen_attention.HALF_DTYPES
            or not varlen_attention.flash_capable(param.device)
            or varlen_attention.varlen_kernel() is None):
        raise ValueError(
            f"cuda_graphs=True needs a CUDA model in bf16/fp16 with flash attention (got "
            f"{param.dtype} on {param.device}): set dtype='bfloat16' and train on a GPU, or "
            "turn cuda_graphs off.")


class GraphedRows:
    """One graph per bucketed row shape (`row_graphs.RowGraphs`) for rows under
    GRAPH_MAX_TOKENS, on the tree path the eager row would take: masked where `auto` gives it
    (FlashAttention 4, rows of `tree_attention.MASKED_MIN_TOKENS` or more), else varlen."""

    def __init__(self, model, cfg: LossConfig):
        self.cfg = cfg
        self.graphs = row_graphs.RowGraphs(model, padded_policy_loss(cfg),
                                           temperature=cfg.temperature, backend="auto",
                                           steps=TRAINER_STEPS)
        self._warned = False

    def takes(self, row: PackedRow) -> bool:
        if row.num_tokens >= GRAPH_MAX_TOKENS:
            return False
        if row_graphs.RowGraphs.supports(row):
            return True
        if row.sampling_mask is not None and not self._warned:
            self._warned = True
            logger.warning("cuda_graphs: rows whose sampler had a candidate set (top_k/top_p/"
                           "min_p) run eagerly; only rows without one replay a graph.")
        return False

    def step(self, row: PackedRow, scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward+backward of `scale` x the row's loss sum; the scaled loss (a copy: the graph's
        output is overwritten by the next replay) and the row's loss metrics, on the device."""
        before = self.captured
        out = self.graphs.step(row, scale)
        if self.captured > before:
            logger.info("cuda_graphs: row shape %d made (%d tokens, %d trained)", self.captured,
                        row.num_tokens, row.num_trained)
        t, inputs = row.num_trained, out.inputs
        (token_sample,) = to_device(self.graphs.device, dense_token_samples(row))
        topk = inputs.get("sampler_topk_logprobs")
        inp = LossInputs(
            logprobs=out.token.logprobs, sampler_logprobs=inputs["sampler_logprobs"][:t],
            advantages=inputs["advantages"][:t], token_sample=token_sample,
            topk_logprobs=out.token.topk_logprobs,
            sampler_topk_logprobs=None if topk is None else topk[:t],
        )
        return out.loss.clone(), loss_metrics(inp, self.cfg, out.token.entropy)

    @property
    def captured(self) -> int:
        """Row shapes made so far (each one warm-up and one capture)."""
        return len(self.graphs.buffers)
