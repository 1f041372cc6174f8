"""The rollout worker alone against a real vLLM server, with a stand-in trainer that pulls.

These tests start the real spawned worker process; each start costs ~20 s on a 2-core box,
so scenarios are grouped: one run shows groups, advantages, drops, backpressure and
staleness; the others show each way the worker can fail and how the trainer side learns it.
"""
from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import pytest
import rollout_test_helpers as helpers
from datasets import Dataset
from grpo_agent import AsyncGRPOConfig
from grpo_agent.rollout.loop import AsyncRolloutLoop
from grpo_agent.rollout.worker import RolloutWorker, RolloutWorkerError
from grpo_agent.types import PromptConsumed, TrainingSample

pytestmark = pytest.mark.vllm

STEP_TOKENS = 300  # what the stand-in trainer claims each step uses


def _config(base_url, tmp_path, cls=AsyncGRPOConfig, **overrides):
    settings = {"output_dir": str(tmp_path), "num_generations": 4, "max_completion_length": 12,
                    "max_concurrent_rollouts": 6, "max_staleness": 1, "rollout_worker_timeout": 60,
                    "vllm_server_base_url": base_url, "report_to": "none", "seed": 0}
    return cls(**{**settings, **overrides})


def _dataset(texts):
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": text}], "row_id": i} for i, text in enumerate(texts)])


def _worker(rollout_server, rollout_tokenizer, tmp_path, reward_funcs, *, loop_cls=AsyncRolloutLoop,
            dataset=None, config=None):
    base_url, model_path = rollout_server
    return RolloutWorker(
        loop_cls, config=config or _config(base_url, tmp_path), model_name=model_path,
        dataset=dataset if dataset is not None else _dataset([f"count to {i}" for i in range(24)]),
        reward_funcs=reward_funcs, processing_class=rollout_tokenizer)


def _values(observations, name):
    return [value for key, value in observations if key == name]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _queue_settles(worker, steady_s: float, within_s: float) -> bool:
    """True once the queue size stays put for `steady_s` (nobody pulls meanwhile)."""
    deadline = time.monotonic() + within_s
    size, since = worker.queue_size, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if worker.queue_size != size:
            size, since = worker.queue_size, time.monotonic()
        elif time.monotonic() - since >= steady_s:
            return True
    return False


def _pull_until(worker, done, seconds, on_items):
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        items = worker.pull(timeout=5.0)
        on_items(items)
        if items:
            worker.report_step_tokens(STEP_TOKENS)


def test_worker_streams_scored_groups_with_drops_backpressure_and_staleness(
        rollout_server, rollout_tokenizer, tmp_path):
    worker = _worker(rollout_server, rollout_tokenizer, tmp_path, [
        helpers.token_sum_reward, helpers.fails_on_some_rows, helpers.child_cuda_visible_devices_reward])
    samples_by_group: dict[int, list[TrainingSample]] = defaultdict(list)
    notices: list[PromptConsumed] = []
    observations = []

    def take(items):
        for item in items:
            if isinstance(item, TrainingSample):
                samples_by_group[item.group_id].append(item)
            else:
                notices.append(item)
        observations.extend(worker.drain_metrics())

    def enough():  # a group's samples may span two pulls: stop only with whole groups
        reasons = {notice.reason for notice in notices}
        whole = all(len(g) == g[0].group_num_samples for g in samples_by_group.values())
        return whole and len(samples_by_group) >= 3 and {"zero_std", "reward_error"} <= reasons

    worker.start()
    try:
        # 1. A consumer keeping up: groups, advantages, zero-std and reward-error drops.
        _pull_until(worker, enough, 150, take)
        assert enough(), f"after 150 s: {len(samples_by_group)} groups, notices {notices}"
        for samples in samples_by_group.values():
            assert len(samples) == samples[0].group_num_samples
            per_rollout = {s.rollout_id: s.advantage for s in samples}
            assert abs(sum(per_rollout.values())) < 1e-6 or len(per_rollout) < 4
            assert all(s.advantage != 0 and s.model_version == 0 for s in samples)
            assert all(s.sequence.num_trained > 0 for s in samples)
        # Every prompt index is consumed at most once: as samples or as a notice.
        indices = [s[0].prompt_index for s in samples_by_group.values()] + [n.prompt_index for n in notices]
        assert len(indices) == len(set(indices))

        # 2. The consumer stalls: generation stops at the token allowance (backpressure).
        # (the wait is observed when it ends: checked after the run, below)
        assert _queue_settles(worker, steady_s=5, within_s=60), "the queue kept growing"
        observations.extend(worker.drain_metrics())

        # 3. Meanwhile the trainer moved two weight updates on: the queued samples are stale.
        worker.set_model_version(2)
        queued = worker.pull(timeout=10)  # one pull takes everything queued
        observations.extend(worker.drain_metrics())
        assert not [i for i in queued if isinstance(i, TrainingSample)]
        stale = [i for i in queued if getattr(i, "reason", "") == "stale"]
        assert stale, "no stale samples were dropped"
        dropped = sum(_values(observations, "sample/dropped_stale_count"))
        assert dropped >= len(stale)
        # What the stalled queue held stayed within the allowance (plus groups in flight).
        smallest = min(s.num_tokens for group in samples_by_group.values() for s in group)
        group_tokens = max(sum(s.num_tokens for s in group) for group in samples_by_group.values())
        assert dropped * smallest <= STEP_TOKENS + 2 * group_tokens

        # 4. max_staleness=0 between taking a step and its push: no new group starts until the
        # trainer reports the step's tokens again (groups already in flight still finish).
        worker.hold_admission()
        assert _queue_settles(worker, steady_s=4, within_s=60)
        worker.pull(timeout=10)
        time.sleep(6)
        assert worker.queue_size == 0 and not worker.pull(timeout=1), "a group started while held"
        worker.report_step_tokens(STEP_TOKENS)
        resumed = []
        _pull_until(worker, lambda: bool(resumed), 90, resumed.extend)
        assert resumed, "generation did not resume after the step's tokens were reported"
        pid = worker.pid
    finally:
        worker.stop()
    assert _gone(pid), "the worker process outlived stop()"
    observations.extend(worker.drain_metrics())

    # The stalled consumer (step 2) held generation for well over a second.
    assert max(_values(observations, "rollout/backpressure_s")) > 1.0
    caps = _values(observations, "rollout/concurrency_cap")
    assert caps and max(_values(observations, "rollout/concurrency")) <= min(caps) <= 6
    assert 0 < sum(_values(observations, "frac_reward_zero_std")) < len(_values(observations, "frac_reward_zero_std"))
    assert sum(_values(observations, "rollout/reward_error_count")) >= 1
    assert set(_values(observations, "rewards/child_cuda_visible_devices_reward/mean")) == {1.0}
    for name in ("reward", "reward_kept", "reward_group_std", "completions/mean_length",
                 "completions/duplicate_frac", "rollout/duration_s", "rollout/score_s",
                 "sample/forwarded_tokens_mean", "rollout/vllm_kv_cache_usage_frac"):
        assert _values(observations, name), f"{name} was never observed"


def test_accuracy_reward_scores_boxed_answers_in_the_workers_scorer_threads(
        rollout_server, rollout_tokenizer, tmp_path):
    """The built-in accuracy_reward on the real path: spawned worker, scorer thread pool.
    Prompts carry an image part, which must be stripped before generate_one (spec)."""
    from grpo_agent.rewards import accuracy_reward

    rows = [{"prompt": [{"role": "user", "content": [
                {"type": "image", "text": None}, {"type": "text", "text": f"What is {a} + {a}?"}]}],
             "solution": str(2 * a)} for a in range(1, 7)]
    worker = _worker(rollout_server, rollout_tokenizer, tmp_path, [accuracy_reward],
                     loop_cls=helpers.BoxedAnswerLoop, dataset=Dataset.from_list(rows))
    groups: dict[int, list[TrainingSample]] = defaultdict(list)
    notices, observations = [], []

    def take(items):
        for item in items:
            (groups[item.group_id] if isinstance(item, TrainingSample) else notices).append(item)
        observations.extend(worker.drain_metrics())

    def two_whole_groups():
        return len(groups) >= 2 and all(len(g) == g[0].group_num_samples for g in groups.values())

    with worker:
        _pull_until(worker, lambda: two_whole_groups() or notices, 180, take)
    observations.extend(worker.drain_metrics())  # what the worker flushed while stopping
    assert not notices, f"groups were dropped: {notices}"  # reward_error before the fix
    assert two_whole_groups()
    scores = _values(observations, "rewards/accuracy_reward/mean")
    assert scores.count(1.0) == scores.count(0.0) >= 4 and set(scores) == {0.0, 1.0}
    for samples in groups.values():  # 2 right, 2 wrong: advantages +1 and -1
        by_rollout = {s.rollout_id: s.advantage for s in samples}
        assert sorted(by_rollout.values()) == pytest.approx([-1.0, -1.0, 1.0, 1.0])
    assert sum(_values(observations, "rollout/reward_error_count")) == 0


def test_the_spec_curriculum_loop_filters_prompts_it_has_solved(rollout_server, rollout_tokenizer, tmp_path):
    texts = ["easy one", "hard one", "easy two", "hard two"]
    config = _config(rollout_server[0], tmp_path, cls=helpers.CurriculumConfig, pass_rate_cap=0.9)
    worker = _worker(rollout_server, rollout_tokenizer, tmp_path, [helpers.easy_or_token_reward],
                     loop_cls=helpers.CurriculumRolloutLoop, dataset=_dataset(texts), config=config)
    filtered_rows = set()

    def take(items):
        filtered_rows.update(i.row_index for i in items if getattr(i, "reason", "") == "filtered")

    with worker:
        _pull_until(worker, lambda: filtered_rows >= {0, 2}, 150, take)
    assert filtered_rows >= {0, 2}, "solved (easy) prompts were never filtered"


def test_a_reward_that_keeps_raising_stops_the_run_with_its_traceback(
        rollout_server, rollout_tokenizer, tmp_path):
    worker = _worker(rollout_server, rollout_tokenizer, tmp_path, [helpers.always_fails])
    with worker, pytest.raises(RolloutWorkerError) as raised:
        _pull_until(worker, lambda: False, 120, lambda items: None)
    message = str(raised.value)
    assert "'always_fails' raised on 10 groups in a row" in message
    assert "RuntimeError: this reward function is broken" in message
    # Every failed group is counted, the one that stopped the run too (it was 9).
    assert sum(_values(worker.drain_metrics(), "rollout/reward_error_count")) == 10


def test_a_worker_killed_by_a_signal_is_reported_by_the_next_pull(rollout_server, rollout_tokenizer, tmp_path):
    worker = _worker(rollout_server, rollout_tokenizer, tmp_path, [helpers.token_sum_reward])
    with worker:
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RolloutWorkerError, match="killed by signal SIGKILL"):
            worker.pull(timeout=30)
        assert time.monotonic() - started < 5


def test_a_hung_worker_is_reported_after_rollout_worker_timeout(rollout_server, rollout_tokenizer, tmp_path):
    config = _config(rollout_server[0], tmp_path, rollout_worker_timeout=4)
    worker = _worker(rollout_server, rollout_tokenizer, tmp_path, [helpers.token_sum_reward],
                     loop_cls=helpers.HangingLoop, config=config)
    worker.start()
    pid = worker.pid
    started = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"no heartbeat for \d+ s \(rollout_worker_timeout=4"):
        worker.pull(timeout=60)
    assert time.monotonic() - started < 15
    worker.stop()
    assert _gone(pid)
