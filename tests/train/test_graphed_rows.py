"""`cuda_graphs=True`: the trainer's rows through `row_graphs` train as its eager rows do.

On CPU nothing is captured (the padded, bucketed step runs as is), so these tests hold the
graphed path's loss, metrics and gradients to the eager trainer's, with score centering's
top-k term and with gradient accumulation; there the device check is the one seam replaced
(it refuses a CPU model). The GPU test captures and replays the graphs (bf16)."""
from __future__ import annotations

import pytest
import torch
from grpo_agent import AsyncGRPOConfig
from grpo_agent.train import graphed_rows, tree_attention
from grpo_agent.types import TrainingSample, TrainingSequence
from transformers import TrainerCallback

from .test_step_read import train


def topk_group(group_id: int) -> list[TrainingSample]:
    """Three samples sharing an 8-token prompt, their sampler's top-4 log-probs per token, near
    the tiny random model's typical ones (-ln 2048 = -7.6), so some ratios fall inside the clip
    range and the loss has a gradient (a masked-out row would compare zeros with zeros)."""
    gen = torch.Generator().manual_seed(group_id)
    prompt = torch.randint(3, 90, (8,), generator=gen).tolist()
    samples = []
    for i in range(3):
        completion = torch.randint(3, 90, (8,), generator=gen).tolist()
        logps = [0.0] * 8 + (-7.8 + 0.4 * torch.rand(8, generator=gen)).tolist()
        top = [None] * 8 + [
            {int(v): float(-7.8 + 0.4 * torch.rand(1, generator=gen))
             for v in torch.randint(3, 90, (4,), generator=gen)}
            for _ in range(8)]
        samples.append(TrainingSample(
            TrainingSequence(prompt + completion, [0] * 8 + [1] * 8, logps,
                             sampler_top_logprobs=top),
            advantage=1.0 - i, model_version=0, group_id=group_id, row_index=group_id,
            prompt_index=group_id, group_num_samples=3))
    return samples


class Gradients(TrainerCallback):
    """Every parameter's gradient at each optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.steps = trainer, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in self.trainer.model.named_parameters()
                           if p.grad is not None})


def _run(tmp_path, graphs: bool, grad_accum: int, monkeypatch, gpu: bool = False,
         tree: str = "auto", compiled: bool = False):
    if graphs and not gpu:
        monkeypatch.setattr(graphed_rows, "_check_device", lambda model: None)
    if tree == "masked":  # both trainers: what `auto` answers where FlashAttention 4 runs
        monkeypatch.setattr(tree_attention, "choose_backend", lambda *args, **kwargs: "masked")
    monkeypatch.setattr(graphed_rows, "TRAINER_STEPS", {
        "tokens": 16, "segments": 4, "keys": 64, "trained": 8, "seqlen": 16, "rows": 16})
    eager_rows = []

    def setup(trainer):
        trainer.samples = [s for g in range(2 * grad_accum + 1) for s in topk_group(g)]
        setup.grads = Gradients(trainer)
        trainer.add_callback(setup.grads)
        inner = trainer.compute_loss

        def compute_loss(model, inputs, **kwargs):
            if inputs.row.num_trained:
                eager_rows.append(inputs.row)
            return inner(model, inputs, **kwargs)

        trainer.compute_loss = compute_loss

    trainer, logs, _ = train(tmp_path / f"{graphs}-{tree}-{compiled}", steps=2, grad_accum=grad_accum,
                             setup=setup, cuda_graphs=graphs, optim="sgd", learning_rate=0.5,
                             num_sampler_logprobs=4, use_cpu=not gpu,
                             dtype="bfloat16" if gpu else "float32", torch_compile=compiled)
    return trainer, logs, setup.grads.steps, eager_rows


def _assert_same_training(tmp_path, monkeypatch, grad_accum, gpu=False, tree="auto",
                          compiled=False):
    eager, eager_logs, eager_grads, _ = _run(tmp_path, False, grad_accum, monkeypatch, gpu, tree,
                                             compiled)
    graphed, logs, grads, eager_rows = _run(tmp_path, True, grad_accum, monkeypatch, gpu, tree,
                                            compiled)
    assert graphed.graphed_rows.captured >= 1 and eager_rows == []  # every row replayed
    paths = {b.backend for b in graphed.graphed_rows.graphs.buffers}
    assert paths == {"masked" if tree == "masked" else "varlen"}
    assert eager.graphed_rows is None
    assert len(grads) == len(eager_grads) == 2
    # CPU: float32, two attention kernels; GPU: bf16 through flash, graphs against eager
    tol = {"atol": 2e-2, "rtol": 2e-2} if gpu else {"atol": 2e-6, "rtol": 1e-4}
    for step, ref in zip(grads, eager_grads):
        assert step.keys() == ref.keys()
        assert sum(g.float().norm() for g in ref.values()) > 1e-3  # a real gradient
        for name, grad in step.items():
            if gpu:
                diff, size = (grad.float() - ref[name].float()).norm(), ref[name].float().norm()
                assert diff <= 2e-2 * size + 1e-6, (name, diff.item(), size.item())
            else:
                torch.testing.assert_close(grad, ref[name], **tol, msg=name)
    for name, p in graphed.model.named_parameters():  # two SGD steps of lr 0.5 moved them
        torch.testing.assert_close(p.float(), dict(eager.model.named_parameters())[name].float(),
                                   **tol)
    assert len(logs) == len(eager_logs) == 2
    for log, ref in zip(logs, eager_logs):
        assert ref["sampling/sampler_mass"] > 0  # the top-k term was there
        assert ref["sampling/masked_mean"] < 0.9  # some tokens inside the clip range
        for key in ("loss", "entropy", "sampling/sampler_mass", "clip_ratio/low_mean",
                    "sampling/importance_sampling_ratio/mean", "sampling/masked_mean"):
            assert log[key] == pytest.approx(ref[key], rel=tol["rtol"], abs=tol["atol"]), key
        assert "perf/fwd_s" not in log and log["perf/fwd_bwd_s"] > 0  # one replay per row
    assert "perf/fwd_s" in eager_logs[0]


@pytest.mark.parametrize(("grad_accum", "tree"), [(1, "auto"), (2, "auto"), (2, "masked")])
def test_graphed_rows_train_as_the_eager_rows(tmp_path, monkeypatch, grad_accum, tree):
    """tree: the path `auto` gives the rows (varlen on a GPU's short rows), or masked."""
    _assert_same_training(tmp_path, monkeypatch, grad_accum, tree=tree)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("grad_accum", "tree", "compiled"), [
    (1, "auto", False), (2, "auto", False), (2, "masked", False), (2, "auto", True),
    (2, "masked", True)])
def test_captured_rows_train_as_the_eager_rows_on_a_gpu(tmp_path, monkeypatch, grad_accum, tree,
                                                        compiled):
    """masked: FlashAttention 4's kernels inside the captured graphs (skipped without them);
    compiled: the compiled layers (SwiGLU as one Triton op) inside them."""
    if tree == "masked":
        from grpo_agent.train import flash_impl

        missing = flash_impl.fa4_kernels_missing(torch.device("cuda"))
        if missing:
            pytest.skip(missing)
    _assert_same_training(tmp_path, monkeypatch, grad_accum, gpu=True, tree=tree,
                          compiled=compiled)


def test_what_graphs_cannot_capture_is_refused(tiny_qwen3):
    base = {"output_dir": "/tmp/unused", "use_cpu": True, "report_to": "none", "cuda_graphs": True}
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        AsyncGRPOConfig(**base)
    with pytest.raises(ValueError, match="bf16/fp16 with flash attention"):
        graphed_rows.check_model(tiny_qwen3)  # a float32 CPU model


def test_long_rows_run_eagerly(tmp_path, monkeypatch):
    """Rows of GRAPH_MAX_TOKENS or more (GPU-bound; their graph pool did not fit beside a 1.7B
    model on an H100) take the eager path, the others replay."""
    monkeypatch.setattr(graphed_rows, "GRAPH_MAX_TOKENS", 30)  # the test's rows hold 34 tokens
    graphed, logs, _, eager_rows = _run(tmp_path, True, 1, monkeypatch)
    assert graphed.graphed_rows.captured == 0 and len(eager_rows) == 2
    assert all("perf/fwd_s" in log for log in logs)
