"""The trainer reads a step's rows once, at the optimizer step: loss metrics weighted by trained
tokens, the NaN/inf loss filter, and throughput/MFU from the packed rows. The trainer runs for
real on the tiny model; only the rollout worker and the weight push are stand-ins."""
from __future__ import annotations

import math

import pytest
import torch
from grpo_agent import AsyncGRPOConfig
from grpo_agent.testing.offline import OfflineTrainer
from grpo_agent.train import perf, step_callback
from grpo_agent.train.batching import plan_step
from grpo_agent.train.forward import forward_row
from grpo_agent.train.loss import build_loss_config, row_loss
from grpo_agent.train.packing import pack_row
from grpo_agent.train.step_rows import StepRows
from grpo_agent.types import TrainingSample, TrainingSequence
from transformers import TrainerCallback

TOKEN_BUDGET = 40  # one group of 3 samples (8-token prompt shared, 8-token completions) per row


def group(group_id: int, sampler_shift: float = 0.0) -> list[TrainingSample]:
    gen = torch.Generator().manual_seed(group_id)
    prompt = torch.randint(3, 90, (8,), generator=gen).tolist()
    samples = []
    for i in range(3):
        completion = torch.randint(3, 90, (8,), generator=gen).tolist()
        logps = [0.0] * 8 + (-7.6 - sampler_shift + 0.2 * torch.rand(8, generator=gen)).tolist()
        samples.append(TrainingSample(
            TrainingSequence(prompt + completion, [0] * 8 + [1] * 8, logps),
            advantage=1.0 - i, model_version=0, group_id=group_id, row_index=group_id,
            prompt_index=group_id, group_num_samples=3))
    return samples


class Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def train(tmp_path, steps, grad_accum=1, logging_steps=1, setup=None, **config):
    args = AsyncGRPOConfig(**{
        "output_dir": str(tmp_path), "max_steps": steps, "gradient_accumulation_steps": grad_accum,
        "logging_steps": logging_steps, "token_budget": TOKEN_BUDGET,
        "gradient_checkpointing": False, "optim": "adamw_torch", "report_to": "none",
        "save_strategy": "no", "disable_tqdm": True, "use_cpu": True, **config})
    from grpo_agent.testing import build_tiny_model

    trainer = OfflineTrainer(build_tiny_model(), args=args, reward_funcs=[],
                             train_dataset=[{"prompt": []}] * 64)  # no datasets on the GPU box
    # Enough groups for every row of every step, plus one that closes the last step.
    trainer.samples = [s for g in range(steps * grad_accum + 1) for s in group(g)]
    logs = Logs()
    trainer.add_callback(logs)
    if setup is not None:
        setup(trainer)
    output = trainer.train()
    return trainer, [log for log in logs.logs if "loss" in log], output


def record_row_losses(trainer):
    """Each row's loss as the Trainer sums it, per step (reads it: only for the expectation)."""
    losses: list[list[float]] = []
    inner = trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        loss = inner(model, inputs, num_items_in_batch)
        if len(losses) <= trainer.state.global_step:
            losses.append([])
        losses[trainer.state.global_step].append(loss.item())
        return loss

    trainer.training_step = training_step
    return losses


def poison_step(trainer, step):
    """The rows of one step return a NaN loss; their gradients stay those of the real loss."""
    inner = trainer.compute_loss

    def compute_loss(model, inputs, **kwargs):
        loss = inner(model, inputs, **kwargs)
        return loss + torch.tensor(math.nan) if trainer.state.global_step == step else loss

    trainer.compute_loss = compute_loss


@pytest.mark.parametrize("nan_filter", [True, False])
def test_a_nan_step_is_left_out_of_the_logged_loss(tmp_path, nan_filter):
    def setup(trainer):
        setup.losses = record_row_losses(trainer)
        poison_step(trainer, step=1)

    trainer, logs, output = train(tmp_path, steps=3, logging_steps=3, setup=setup,
                                  logging_nan_inf_filter=nan_filter)
    steps = [sum(rows) for rows in setup.losses]
    assert math.isnan(steps[1]) and math.isfinite(steps[0]) and math.isfinite(steps[2])
    assert abs(steps[2]) > 1e-3  # else transformers' per-row rule would give the same number
    assert len(logs) == 1
    if nan_filter:
        assert logs[0]["loss"] == pytest.approx((steps[0] + steps[2]) / 2, rel=1e-6)
        assert math.isfinite(output.training_loss)
    else:
        assert math.isnan(logs[0]["loss"])
    assert trainer.args.logging_nan_inf_filter is nan_filter  # as the user set it, after train


def test_the_filter_adds_no_read_per_row(tmp_path, monkeypatch):
    """Transformers' own filter reads every row's loss (a host wait per row on a GPU); here the
    only read of the rows is StepRows.read, once per optimizer step, whatever the rows."""
    checked, reads = [], []
    real_isnan, real_read = torch.isnan, StepRows.read

    def isnan(tensor, *args, **kwargs):
        checked.append(tensor)
        return real_isnan(tensor, *args, **kwargs)

    def read(self, *args, **kwargs):
        reads.append(len(self._losses))
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(torch, "isnan", isnan)
    monkeypatch.setattr(StepRows, "read", read)

    def setup(trainer):
        returned = setup.returned = []
        inner = trainer.training_step

        def training_step(*args, **kwargs):
            returned.append(inner(*args, **kwargs))
            return returned[-1]

        trainer.training_step = training_step

    trainer, logs, _ = train(tmp_path, steps=2, grad_accum=3, setup=setup)
    assert trainer.args.logging_nan_inf_filter is True  # the spec's default
    assert len(setup.returned) == 6
    assert not [t for t in checked if any(t is loss for loss in setup.returned)]
    assert reads == [3, 3]  # one read per optimizer step, of its three rows
    assert all(math.isfinite(log["loss"]) and "entropy" in log for log in logs)


def test_throughput_and_mfu_count_the_packed_rows(tmp_path, monkeypatch):
    peak = 1e12
    monkeypatch.setattr(step_callback, "_device_peak", lambda args: peak)
    trainer, logs, _ = train(tmp_path, steps=1)
    (log,) = logs
    rows = plan_step(group(0), token_budget=TOKEN_BUDGET, num_processes=1,
                     grad_accum_steps=1).microbatches[0]
    packed = sum(row.num_tokens for row in rows)
    assert packed == 7 + 3 * 9 and sum(row.unpacked_tokens for row in rows) == 3 * 16
    assert log["batch/forwarded_tokens_per_step"] == packed
    seconds = log["perf/fwd_bwd_s"]
    assert log["perf/fwd_bwd_forwarded_tokens_per_s"] * seconds == pytest.approx(packed)
    flops = perf.packed_training_flops(trainer.model.config, rows)
    assert log["perf/fwd_bwd_mfu"] * seconds * peak == pytest.approx(flops)
    assert log["perf/wall_clock_mfu"] * log["perf/step_s"] * peak == pytest.approx(flops)


def test_loss_metrics_are_means_over_the_steps_trained_tokens(tiny_qwen3):
    """Two rows with 8 and 16 trained tokens: entropy and the log-prob difference are means
    over the 24 tokens, not over the two rows (whose sampler log-probs differ by about 2)."""
    from grpo_agent.train.tree_attention import enable_tree_attention

    enable_tree_attention(tiny_qwen3)
    cfg = build_loss_config(AsyncGRPOConfig(output_dir="/tmp/unused", score_centering=False))
    rows = [pack_row(group(0)[:1]), pack_row(group(1, sampler_shift=2.0)[:2])]
    step = StepRows()
    for row in rows:
        loss, metrics = row_loss(tiny_qwen3, row, cfg, 24)
        step.add_metrics(metrics, row.num_trained)
        step.add_loss(loss)
    reading = step.read(torch.device("cpu"))
    with torch.no_grad():
        tokens = [forward_row(tiny_qwen3, row, temperature=1.0).token for row in rows]
    entropy = torch.cat([t.entropy for t in tokens])
    diff = torch.cat([(t.logprobs - row.sampler_logprobs).abs() for t, row in zip(tokens, rows)])
    assert len(entropy) == 24
    assert reading.metrics["entropy"] == pytest.approx(entropy.mean().item(), rel=1e-5)
    assert reading.metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(
        diff.mean().item(), rel=1e-5)
    assert reading.metrics["sampling/sampling_logp_difference/max"] == pytest.approx(
        diff.max().item(), rel=1e-5)
    row_means = sum(d.mean().item() for d in diff.split([8, 16])) / 2
    assert abs(reading.metrics["sampling/sampling_logp_difference/mean"] - row_means) > 0.1


def test_the_steps_loss_is_the_sum_of_its_rows_losses():
    """Each row's loss is already divided by the micro-batch's trained tokens (and the
    accumulation steps), so the step's logged loss is their sum, not their mean."""
    step = StepRows()
    for value in (0.25, 0.5, 1.0):
        step.add_loss(torch.tensor(value))
    assert step.read(torch.device("cpu")).loss == pytest.approx(1.75)


def test_a_step_averages_its_micro_batches_and_weighs_metrics_by_trained_tokens(tmp_path):
    """gradient_accumulation_steps=2 over rows of unequal trained tokens: the step's loss is
    the mean of the micro-batches' token-mean losses (the spec averages over the accumulation
    steps; their sum doubles the update), and a loss metric, through the trainer's own rows,
    is the mean over the step's trained tokens, not the mean of its rows."""
    import copy

    short = group(1, sampler_shift=2.0)[:1]  # one sample, its last 4 tokens trained
    short[0].sequence.trained_mask = [0] * 12 + [1] * 4

    def setup(trainer):
        trainer.samples = group(0) + short + group(2)
        setup.before, setup.rows = copy.deepcopy(trainer.model), []
        inner = trainer.compute_loss

        def compute_loss(model, inputs, **kwargs):
            setup.rows.append(inputs.row)
            return inner(model, inputs, **kwargs)

        trainer.compute_loss = compute_loss

    trainer, (log,), _ = train(tmp_path, steps=1, grad_accum=2, setup=setup)
    rows = setup.rows
    assert len(rows) == 2 and rows[0].num_trained != rows[1].num_trained
    cfg = build_loss_config(trainer.args, setup.before)
    losses = [row_loss(setup.before, row, cfg, row.num_trained)[0].item() for row in rows]
    assert log["loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert abs(sum(losses) / 2) > 1e-3  # the mean and the sum differ
    with torch.no_grad():
        diffs = [(forward_row(setup.before, row, temperature=1.0).token.logprobs
                  - row.sampler_logprobs).abs() for row in rows]
    logged = log["sampling/sampling_logp_difference/mean"]
    assert logged == pytest.approx(torch.cat(diffs).mean().item(), rel=1e-5)
    assert abs(logged - (diffs[0].mean() + diffs[1].mean()).item() / 2) > 0.1


def test_steps_are_planned_with_the_cyclic_collector_off_and_the_heap_thawed_after(
        tmp_path, monkeypatch):
    """A step's trie (a node per token, built as samples are placed) is built and planned with
    the collector paused; what existed at train begin is frozen before step 1 is planned, what
    step 1 built before step 2 is, and train returns with the heap thawed."""
    import gc

    from grpo_agent.train.batching import StepPlanner

    placed, planned = [], []
    add, plan = StepPlanner.add, StepPlanner.plan

    def placing(self, sample):
        placed.append(gc.isenabled())
        return add(self, sample)

    def planning(self, leftover=None):
        planned.append((gc.isenabled(), gc.get_freeze_count()))
        return plan(self, leftover)

    monkeypatch.setattr(StepPlanner, "add", placing)
    monkeypatch.setattr(StepPlanner, "plan", planning)
    assert gc.isenabled()
    train(tmp_path, steps=3)
    assert placed and not any(placed)  # every sample placed into a trie with the collector off
    assert [enabled for enabled, _ in planned] == [False] * 3
    frozen = [count for _, count in planned]
    # frozen at train begin, then more after step 1 (frozen objects only leave when they die)
    assert 0 < frozen[0] < frozen[1]
    assert gc.isenabled() and gc.get_freeze_count() == 0  # as before train


@pytest.mark.parametrize("save_steps", [None, 2])
def test_the_next_step_is_planned_before_the_wait_for_this_ones_rows(tmp_path, save_steps):
    """A step's end plans the next step first and waits for the GPU after (the host plans
    while the GPU finishes the rows), except where the step saves or ends the run: a
    checkpoint never holds pulled, untrained samples. Every group is trained once, in order."""
    events = []

    def setup(trainer):
        step = lambda: trainer.state.global_step
        for name, label in (("_next_step_plan", "plan"), ("read_step_rows", "read")):
            inner = getattr(trainer, name)

            def recorded(*args, _inner=inner, _label=label, **kwargs):
                events.append((_label, step()))
                return _inner(*args, **kwargs)

            setattr(trainer, name, recorded)
        end_step = trainer.end_step

        def ending(state):
            events.append(("end", state.global_step,
                           sorted({s.group_id for s in trainer._step_samples})))
            return end_step(state)

        trainer.end_step = ending

    config = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    train(tmp_path, steps=3, setup=setup, **config)
    # ("plan", n): planned when n steps had ended, i.e. step n + 1's plan
    assert events == [
        ("plan", 0), ("end", 1, [0]), ("plan", 1), ("read", 1),
        ("end", 2, [1]), *([("read", 2), ("plan", 2)] if save_steps else [("plan", 2), ("read", 2)]),
        ("end", 3, [2]), ("read", 3),  # the last step plans nothing ahead
    ]


@pytest.mark.parametrize("flag", [None, "should_training_stop", "should_save",
                                  "should_evaluate"])
def test_nothing_is_planned_ahead_of_a_save_an_evaluation_or_the_end(flag):
    """The rule alone (the save and the end also run whole above): an evaluation, like a
    checkpoint, never happens with pulled samples untrained."""
    from types import SimpleNamespace

    from grpo_agent.train.pipeline import RolloutPipelineMixin

    flags = dict.fromkeys(("should_training_stop", "should_save", "should_evaluate"), False)
    if flag:
        flags[flag] = True
    trainer = SimpleNamespace(_planned_ahead=None, _next_step_plan=lambda: "next plan")
    RolloutPipelineMixin.plan_ahead(trainer, SimpleNamespace(**flags))
    assert trainer._planned_ahead == (None if flag else "next plan")


def test_a_step_planned_ahead_is_dropped_when_the_run_is_interrupted(tmp_path):
    """Ctrl-C while step 1 is logged, after step 2 was planned ahead: the plan goes with the
    stopped worker, so a later train() in this process does not train its samples."""
    class Interrupt(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                interrupt.ahead = trainer._planned_ahead
                raise KeyboardInterrupt

    interrupt, trainer = Interrupt(), None

    def setup(t):
        nonlocal trainer
        trainer = t
        t.add_callback(interrupt)

    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, steps=3, setup=setup)
    assert interrupt.ahead is not None  # step 2 had been planned when step 1 was logged
    assert trainer._planned_ahead is None


def run_offline(tmp_path, dataset_size, groups, **config):
    """An offline run over a dataset of `dataset_size` prompts, with `groups` groups scripted."""
    args = AsyncGRPOConfig(**{
        "output_dir": str(tmp_path), "token_budget": TOKEN_BUDGET, "gradient_checkpointing": False,
        "optim": "adamw_torch", "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
        "use_cpu": True, "logging_steps": 1, **config})
    from grpo_agent.testing import build_tiny_model

    trainer = OfflineTrainer(build_tiny_model(), args=args, reward_funcs=[],
                             train_dataset=[{"prompt": []}] * dataset_size)
    trainer.samples = [s for g in range(groups) for s in group(g)]
    logs = Logs()
    trainer.add_callback(logs)
    trainer.train()
    return trainer, [log for log in logs.logs if "loss" in log]


@pytest.mark.parametrize("grad_accum,dataset_size", [(1, 2), (2, 3)])
def test_a_run_without_max_steps_ends_when_its_prompt_epochs_are_trained(
        tmp_path, monkeypatch, grad_accum, dataset_size):
    """num_train_epochs counts prompts: the run stops at the step that trains the last one
    (one group per row here), its epoch exactly 1, without asking the worker for more; a last
    step the queue cannot fill is padded with empty rows (grad_accum=2 over 3 prompts: the
    second step has one group)."""
    from grpo_agent.testing.offline import ScriptedWorker

    def pull(self, timeout, version=None):
        if not self.batches:
            raise AssertionError("pulled again after the run's prompt epochs were all in hand")
        return self.batches.pop(0)

    monkeypatch.setattr(ScriptedWorker, "pull", pull)
    trainer, logs = run_offline(tmp_path, dataset_size, groups=dataset_size, max_steps=-1,
                                num_train_epochs=1, gradient_accumulation_steps=grad_accum)
    assert trainer.state.global_step == 2 and trainer.state.epoch == pytest.approx(1.0)
    assert trainer.ledger.frontier == dataset_size
    assert all(math.isfinite(log["loss"]) for log in logs)


@pytest.mark.parametrize("ends_by", ["max_steps", "prompt epochs"])
def test_the_last_steps_are_logged_though_logging_steps_does_not_divide_the_run(tmp_path,
                                                                                ends_by):
    """transformers logs at multiples of logging_steps only: a run of 3 steps at
    logging_steps=2 lost its third step's row (its loss, rewards, tool failures)."""
    ends, groups = (({"max_steps": 3}, 4) if ends_by == "max_steps"  # one group closes step 3
                    else ({"max_steps": -1, "num_train_epochs": 1}, 3))
    trainer, logs = run_offline(tmp_path, dataset_size=3, groups=groups, logging_steps=2, **ends)
    assert trainer.state.global_step == 3
    assert [log["step"] for log in trainer.state.log_history if "loss" in log] == [2, 3]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)


def test_max_steps_wins_over_the_prompt_epochs(tmp_path):
    trainer, _ = run_offline(tmp_path, dataset_size=2, groups=4, max_steps=3, num_train_epochs=1)
    assert trainer.state.global_step == 3


def test_without_max_steps_the_step_bound_is_out_of_reach():
    from types import SimpleNamespace

    from grpo_agent.train.trainer import AsyncGRPOTrainer

    host = SimpleNamespace(get_total_train_batch_size=lambda args: 1)
    args = SimpleNamespace(max_steps=-1, gradient_accumulation_steps=2)
    values = AsyncGRPOTrainer.set_initial_training_values(host, args, None)
    assert values[1] >= 10**9 and values[5] == 2 * values[1]
    args.max_steps = 7
    assert AsyncGRPOTrainer.set_initial_training_values(host, args, None)[1] == 7


def test_weights_are_pushed_every_weight_sync_steps_and_at_the_last_step(tmp_path):
    """Step 5 of a weight_sync_steps=2 run was never pushed: the run ended serving step 4's
    weights, which its last evaluation and trainer.evaluate() then scored as step 5's."""
    events = []

    def setup(trainer):
        trainer.push_weights = lambda: events.append(
            ("push", trainer.state.global_step, trainer.model_version))
        trainer.settle_push = lambda: events.append(
            ("settle", trainer.state.global_step, trainer.model_version))

    train(tmp_path, steps=5, setup=setup, weight_sync_steps=2)
    assert events == [("push", 2, 1), ("push", 4, 2), ("push", 5, 3), ("settle", 5, 3)]


def test_num_tokens_counts_every_forwarded_token_so_far_shared_prefixes_once(tmp_path):
    """Each step forwards one group: its 8-token prompt less the last token once (7), then per
    sample the prompt's last token and 8 completion tokens (3 x 9)."""
    _, logs, _ = train(tmp_path, steps=3)
    assert [log["num_tokens"] for log in logs] == [34.0, 68.0, 102.0]


@pytest.mark.parametrize("max_steps", [0, -1])
def test_without_a_dataset_max_steps_must_bound_the_run(max_steps):
    """An environment's prompts have no count: without max_steps > 0 the run would not end."""
    from types import SimpleNamespace

    from grpo_agent.train.trainer import _check_dataset

    with pytest.raises(ValueError, match="set max_steps > 0"):
        _check_dataset(None, object(), SimpleNamespace(max_steps=max_steps))
    _check_dataset(None, object(), SimpleNamespace(max_steps=1))


def test_the_last_step_trains_no_prompt_past_the_run_epochs(tmp_path):
    """The worker runs ahead of the run's end: here it hands over four groups at once for a
    dataset of two prompts. A step of three rows takes the epoch's two groups and pads the
    third row; the third and fourth prompts (the next epoch's) are not trained."""
    trainer, _ = run_offline(tmp_path, dataset_size=2, groups=4, max_steps=-1,
                             num_train_epochs=1, gradient_accumulation_steps=3)
    assert trainer.state.global_step == 1 and trainer.state.epoch == pytest.approx(1.0)
    assert trainer.ledger.frontier == 2
    assert sorted({s.prompt_index for s in trainer._step_samples}) == [0, 1]


def test_dropped_groups_past_the_runs_prompts_move_neither_the_ledger_nor_the_epoch(tmp_path, monkeypatch):
    """The worker runs ahead and drops groups past the last prompt (here prompts 2 and 3 of a
    2-prompt, 1-epoch run): they moved the ledger's frontier to 4 and the logged epoch to 2.0."""
    from grpo_agent.testing.offline import ScriptedWorker
    from grpo_agent.types import PromptConsumed

    def init(self, samples):
        self.batches = [samples + [PromptConsumed(2, 0, "filtered"), PromptConsumed(3, 1, "filtered")]]

    monkeypatch.setattr(ScriptedWorker, "__init__", init)
    trainer, _ = run_offline(tmp_path, dataset_size=2, groups=2, max_steps=-1,
                             num_train_epochs=1, gradient_accumulation_steps=2)
    assert trainer.ledger.frontier == 2  # the resume point stays in the run's epoch
    assert trainer.state.epoch == pytest.approx(1.0)


def test_a_trainer_built_on_a_rank_above_0_quiets_its_warnings(tmp_path, monkeypatch):
    """Python-API runs under torchrun build the trainer on every rank: only rank 0 warns (the
    start-up checks ran once per rank); errors still show. Without the call in the trainer's
    constructor, rank 1's `grpo_agent` logger kept WARNING."""
    import logging

    from grpo_agent.testing import build_tiny_model

    package = logging.getLogger("grpo_agent")
    level = package.level
    monkeypatch.setenv("RANK", "1")  # no process group: the launcher's rank decides
    try:
        args = AsyncGRPOConfig(output_dir=str(tmp_path), token_budget=TOKEN_BUDGET, use_cpu=True,
                               report_to="none", save_strategy="no", disable_tqdm=True)
        OfflineTrainer(build_tiny_model(), args=args, reward_funcs=[],
                       train_dataset=[{"prompt": []}])
        assert package.getEffectiveLevel() == logging.ERROR
    finally:
        package.setLevel(level)


def poison_gradients(trainer, steps):
    """The rows of these steps (0-based) return a loss whose gradients are NaN."""
    inner = trainer.compute_loss

    def compute_loss(model, inputs, **kwargs):
        loss = inner(model, inputs, **kwargs)
        return loss * torch.tensor(math.nan) if trainer.state.global_step in steps else loss

    trainer.compute_loss = compute_loss


class Weights(TrainerCallback):
    """The model's weights after each optimizer step, by step number."""

    def __init__(self, trainer):
        self.trainer, self.after = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = [p.detach().clone() for p in self.trainer.model.parameters()]


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_a_step_whose_gradient_norm_is_nan_leaves_the_weights_and_adam_alone(tmp_path, optim,
                                                                              caplog):
    """A NaN gradient used to reach the weights (and, pushed, the vLLM server). Fused AdamW
    skips on the device (`found_inf`), other optimizers by dropping the gradients."""
    def setup(trainer):
        poison_gradients(trainer, {1})
        setup.weights = Weights(trainer)
        trainer.add_callback(setup.weights)

    with caplog.at_level("WARNING", logger="grpo_agent.train.update_guard"):
        trainer, logs, _ = train(tmp_path, steps=3, setup=setup, optim=optim)
    after = setup.weights.after
    assert all(torch.isfinite(w).all() for weights in after.values() for w in weights)
    assert all(torch.equal(a, b) for a, b in zip(after[1], after[2]))  # step 2 skipped
    assert any(not torch.equal(a, b) for a, b in zip(after[2], after[3]))  # step 3 trained
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") \
        else trainer.optimizer
    steps = {float(state["step"]) for state in optimizer.state.values()}
    assert steps == {2.0}  # two updates counted, the skipped one not
    assert [log["optimizer/skipped_step_count"] for log in logs] == [0.0, 1.0, 0.0]
    warned = ("Step 2: the gradient norm is nan, so its update was skipped (the weights keep the "
              "last finite step's).")
    assert [r.getMessage() for r in caplog.records] == [warned]


def test_a_run_whose_steps_keep_a_nan_gradient_stops_naming_them(tmp_path):
    from grpo_agent.train.update_guard import NonFiniteGradientError

    def setup(trainer):
        poison_gradients(trainer, {1, 2, 3, 4})
        setup.weights, setup.logs = Weights(trainer), Logs()
        trainer.add_callback(setup.weights)
        trainer.add_callback(setup.logs)

    with pytest.raises(NonFiniteGradientError, match=r"^The gradient norm was NaN/inf at steps "
                                                     r"2, 3, 4 in a row: their updates were skipped"):
        train(tmp_path, steps=6, setup=setup, optim="adamw_torch_fused")
    after = setup.weights.after  # the error comes at step 4's read, before this callback
    assert sorted(after) == [1, 2, 3]
    final = list(setup.weights.trainer.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(after[1], final))
    # The failed run's last row (what it counted since step 3) has step 4's skip too.
    assert [log["optimizer/skipped_step_count"] for log in setup.logs.logs] == [0.0, 1.0, 1.0, 1.0]


def test_a_norm_already_read_as_a_float_skips_by_dropping_the_gradients():
    """transformers hands a float under DeepSpeed: no device flag to give a fused optimizer (a
    CPU flag beside CUDA weights would fail), so the gradients are dropped instead."""
    from grpo_agent.train.update_guard import UpdateGuard

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.full((3,), math.nan)
    guard = UpdateGuard()
    guard.arm(optimizer, math.nan)
    optimizer.step()
    assert weight.grad is None and not hasattr(optimizer, "found_inf")
    assert weight.detach().tolist() == [1.0, 1.0, 1.0] and guard.read(step=1) == 1.0
