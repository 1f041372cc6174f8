"""The engine's books without a server: what a scored, dropped or stalled group moves (the
tokens queued and the mean group size the dispatcher's room rule reads, the groups in flight,
the notices and counts), what dispatch promises and notices, and which failures cost only
their group. The engine is real; scoring, the loop and the channels are scripted seams."""
from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest
from grpo_agent.rollout import engine as engine_module
from grpo_agent.rollout.group_scoring import ScoredGroup
from grpo_agent.rollout.prompts import PromptSlot
from grpo_agent.rollout.unfinished import CallsSoFar
from grpo_agent.sampler.errors import RequestRejectedError
from grpo_agent.types import PromptConsumed

from tests.stand_in_engine import make_engine


def room_at(engine, value):
    engine.channels.token_allowance.value = value
    return engine._allowance_has_room()


def scored_as(monkeypatch, samples, reason, observations=()):
    async def score_group(loop, group, failures):
        return ScoredGroup(list(samples), reason, list(observations))

    monkeypatch.setattr(engine_module, "score_group", score_group)


def group_of(*sequence_lengths):
    """A finished group whose rollouts built sequences of these token lengths."""
    return SimpleNamespace(prompt_index=3, row_index=7, group_id=0, completions_sequences=[
        [SimpleNamespace(token_ids=[0] * n) for n in lengths] for lengths in sequence_lengths])


def test_a_scored_group_queues_its_samples_and_sizes_the_groups_still_in_flight(monkeypatch):
    """The dispatcher commits the tokens queued (the kept samples: 12 + 18) plus, per group in
    flight, the mean tokens of a finished group (all its sequences: 10 + 20 + 5)."""
    engine, put = make_engine()
    samples = [SimpleNamespace(num_tokens=12), SimpleNamespace(num_tokens=18)]
    scored_as(monkeypatch, samples, None)
    engine._groups_in_flight = 1  # dispatched
    asyncio.run(engine._score(group_of([10], [20, 5])))
    assert put == samples
    assert engine.stall_context()["groups_awaiting_score"] == 0
    assert room_at(engine, 31) and not room_at(engine, 30)  # 30 queued, nothing in flight
    engine._groups_in_flight = 1  # one more dispatched: 30 + 35 committed
    assert room_at(engine, 66) and not room_at(engine, 65)


def test_a_group_without_signal_is_consumed_untrained_but_still_sizes_the_mean_group(monkeypatch):
    engine, put = make_engine()
    scored_as(monkeypatch, [], "zero_std")
    engine._groups_in_flight = 2
    asyncio.run(engine._score(group_of([40], [40])))
    assert put == [PromptConsumed(3, 7, "zero_std")]
    assert room_at(engine, 81) and not room_at(engine, 80)  # 0 queued + 1 in flight x 80


def test_a_stalled_group_is_dropped_counted_and_leaves_the_mean_group_alone(monkeypatch):
    engine, put = make_engine()
    scored_as(monkeypatch, [], "stalled", [("rollout/score_s", 1.0)])
    engine._groups_in_flight = 1
    asyncio.run(engine._score(group_of([40], [40])))
    assert put == [PromptConsumed(3, 7, "stalled")]
    assert ("rollout/stalled_group_count", 1.0) in engine._observations
    assert ("rollout/score_s", 1.0) in engine._observations
    context = engine.stall_context()
    assert context["stalled_groups"] == 1 and context["groups_awaiting_score"] == 0
    # No group finished: the dispatcher still starts groups one at a time.
    assert room_at(engine, 1e9)
    engine._groups_in_flight = 1
    assert not room_at(engine, 1e9)


def _engine_with_a_hung_scorer(monkeypatch, run_episode):
    """Cap 2, two rollouts a group, a scorer that never finishes, an allowance that admits
    many groups; rollouts run `run_episode`."""
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(64)]

    async def build_group(loop, slot, group_id, version, results, observe, observe_rate):
        return SimpleNamespace(queued_at=0.0, group_id=group_id)

    async def hung_score_group(loop, group, failures):
        await asyncio.Event().wait()

    monkeypatch.setattr(engine_module, "build_group", build_group)
    monkeypatch.setattr(engine_module, "score_group", hung_score_group)
    monkeypatch.setattr(engine_module, "ALLOWANCE_POLL_S", 0.001)
    engine, _ = make_engine(num_generations=2, cap=2, dataset=rows, dataset_start_index=0,
                            filter_prompt=lambda index, row, epoch: True, run_episode=run_episode)
    engine.channels.token_allowance.value = 1e9
    engine._groups_done, engine._group_tokens_total = 1, 10
    return engine


async def _run_dispatch_and_scorer(engine, queue_size, until):
    """Dispatch and score until `until()` holds (10 s at most: a dispatcher that stops for
    good fails here, not at the suite's timeout), settle, return the stall context."""
    engine.score_queue = asyncio.Queue(queue_size)
    engine._fatal = asyncio.get_running_loop().create_future()
    tasks = [asyncio.create_task(engine._dispatch()), asyncio.create_task(engine._score_forever())]
    await asyncio.wait_for(until(), 10)
    await asyncio.sleep(0.1)
    context = engine.stall_context()
    for task in [*tasks, *engine._group_tasks]:
        task.cancel()
    await asyncio.gather(*tasks, *engine._group_tasks, return_exceptions=True)
    return context


def test_the_stall_report_tells_generating_groups_from_those_awaiting_their_score(monkeypatch):
    """A new user's stall report said `groups_in_flight: 97` under max_concurrent_rollouts=8:
    the count was every group dispatched and not yet scored, most of them generated and
    waiting for a hung scorer. The report splits them. Here (a score queue of two) group 0 is
    being scored, group 1 is queued, and group 2 generates on both slots, so nothing more is
    dispatched."""
    generating = {}  # group_id -> released when its rollouts may finish

    async def run_episode(row, row_index, group_id):
        await generating.setdefault(group_id, asyncio.Event()).wait()
        return None, SimpleNamespace(turns=[]), None

    engine = _engine_with_a_hung_scorer(monkeypatch, run_episode)

    async def until():
        for group_id in range(2):
            while group_id not in generating:
                await asyncio.sleep(0.001)
            generating[group_id].set()  # its rollouts finish: slots free, the next is dispatched
        while 2 not in generating or engine.slots.in_flight < 2:
            await asyncio.sleep(0.001)

    context = asyncio.run(_run_dispatch_and_scorer(engine, 2, until))
    assert {key: context[key] for key in (
        "groups_generating", "groups_awaiting_score", "rollouts_running",
        "rollouts_waiting_for_slot", "concurrency_cap", "score_queue_size")} == {
        "groups_generating": 1, "groups_awaiting_score": 2, "rollouts_running": 2,
        "rollouts_waiting_for_slot": 0, "concurrency_cap": 2, "score_queue_size": 1}
    assert "groups_in_flight" not in context  # it read as "being generated"


def test_a_stall_report_before_scheduling_has_the_servers_context_and_no_slots():
    """The worker's stall watch starts before the engine connects, so a hung connect is
    reported while there are no slots or score queue yet: the context says None for them and
    still names the server (if it raised, the report said only 'context unavailable')."""
    engine, _ = make_engine()
    engine.slots = engine.score_queue = None
    context = engine.stall_context()
    assert context["server"] == "http://x"
    assert [context[key] for key in ("rollouts_running", "rollouts_waiting_for_slot",
                                     "concurrency_cap", "score_queue_size")] == [None] * 4


def test_a_full_score_queue_stops_the_dispatcher(monkeypatch):
    """Slow rewards must slow generation: with the scorer hung and its queue of one full, no
    group starts. At most one group (cap 2, two rollouts) was generating when the queue filled,
    so 3 groups at most are ever dispatched; without the rule the dispatcher kept starting
    groups until the token allowance stopped it (a trial's stall report: 97 awaiting score)."""
    async def run_episode(row, row_index, group_id):
        return None, SimpleNamespace(turns=[]), None

    engine = _engine_with_a_hung_scorer(monkeypatch, run_episode)

    async def until():
        while not engine.score_queue.full():
            await asyncio.sleep(0.001)

    context = asyncio.run(_run_dispatch_and_scorer(engine, 1, until))
    assert context["score_queue_size"] == 1
    assert context["groups_generating"] == 0
    assert 2 <= context["groups_awaiting_score"] <= 3  # scored, queued, maybe one blocked


def test_dispatch_promises_a_groups_rollouts_and_notices_the_prompts_it_filtered(monkeypatch):
    rows = [{"prompt": [{"role": "user", "content": str(i)}], "keep": i % 2 == 0} for i in range(4)]
    engine, put = make_engine(num_generations=3, dataset=rows, dataset_start_index=0,
                              filter_prompt=lambda index, row, epoch: row["keep"])
    started, waits = [], []

    async def run_group(slot, group_id):
        started.append(slot.row_index)

    async def wait_for_room():
        waits.append(1)
        if len(waits) == 3:
            raise asyncio.CancelledError  # the first epoch is dispatched
        await asyncio.sleep(0)

    monkeypatch.setattr(engine, "_run_group", run_group)
    monkeypatch.setattr(engine, "_wait_for_room", wait_for_room)

    async def main():
        with pytest.raises(asyncio.CancelledError):
            await engine._dispatch()

    asyncio.run(main())
    assert sorted(started) == [0, 2]
    assert engine.slots.promised == 6 and engine._groups_in_flight == 2
    assert {p.row_index for p in put} == {1, 3}  # the next epoch may have begun with one
    assert {p.reason for p in put} == {"filtered"}


def test_a_dropped_group_withdraws_only_its_own_promises():
    """Another group's promised rollouts stay promised when one group is dropped."""
    async def hang(*args):
        await asyncio.sleep(3600)

    async def main():
        engine, _ = make_engine(cap=1, run_episode=hang)
        engine.slots.promise(2)  # the group dropped below
        engine.slots.promise(3)  # another group's, still to run
        took_slot = [0]
        slot = SimpleNamespace(row={}, row_index=0)
        rollouts = [asyncio.ensure_future(engine._run_rollout(slot, 0, took_slot, None, CallsSoFar()))
                    for _ in range(2)]
        await asyncio.sleep(0.1)
        await engine._cancel_group(rollouts, took_slot, 0)
        return engine.slots.promised

    assert asyncio.run(main()) == 3


def test_a_rejected_request_that_is_no_group_failure_stops_the_run(monkeypatch):
    """HTTP 400 for a too-long prompt costs its group; any other rejection is a bug to show."""
    engine, put = make_engine()
    rejected = RequestRejectedError("POST /generate was rejected with HTTP 401", status_code=401,
                                    server_message="unauthorised")

    async def rollout(slot, group_id, took_slot, shared, calls):
        raise rejected

    monkeypatch.setattr(engine, "_run_rollout", rollout)
    engine._groups_in_flight = 1
    with pytest.raises(RequestRejectedError):
        asyncio.run(engine._run_group(PromptSlot(0, 0, 0, {}), 0))
    assert put == []


def test_an_error_that_stops_the_run_cancels_the_groups_other_rollouts(monkeypatch):
    """gather ends at the first rollout's error; a sibling still in a tool call was left running
    (calling tools and the server after the run stopped) until the worker's loop closed."""
    cancelled = []

    async def rollout(slot, group_id, took_slot, shared, calls):
        if not cancelled and group_id == "first":
            raise ValueError("a bug in the user's hook")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(group_id)
            raise

    async def main():
        engine, _ = make_engine()
        names = iter(["first", "second"])
        monkeypatch.setattr(engine, "_run_rollout", lambda slot, group_id, took, shared, calls:
                            rollout(slot, next(names), took, shared, calls))
        engine._groups_in_flight = engine._groups_generating = 1
        with pytest.raises(ValueError, match="user's hook"):
            await engine._run_group(PromptSlot(0, 0, 0, {}), 0)
        return list(cancelled)

    assert asyncio.run(main()) == ["second"]


def test_a_failed_group_task_fails_the_engine():
    async def main():
        engine, _ = make_engine()
        engine._fatal = asyncio.get_running_loop().create_future()

        async def boom():
            raise ValueError("reward bug")

        task = asyncio.create_task(boom())
        engine._group_tasks.add(task)
        task.add_done_callback(engine._group_finished)
        with pytest.raises(ValueError, match="reward bug"):
            await asyncio.wait_for(engine._fatal, 5)
        assert not engine._group_tasks

    asyncio.run(main())


def test_no_group_starts_while_the_server_is_down_and_only_a_closed_allowance_counts_as_backpressure(
        monkeypatch):
    import threading

    monkeypatch.setattr(engine_module, "ALLOWANCE_POLL_S", 0.01)
    engine, _ = make_engine()
    engine.channels.server_down = threading.Event()
    engine.channels.token_allowance.value = 1e9

    async def main():
        engine.channels.server_down.set()
        waiting = asyncio.create_task(engine._wait_for_room())
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the server is down: nothing dispatches
        engine.channels.server_down.clear()
        await asyncio.wait_for(waiting, 5)
        engine._groups_in_flight = 1  # no group finished yet: one at a time
        waiting = asyncio.create_task(engine._wait_for_room())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        engine._groups_in_flight = 0
        await asyncio.wait_for(waiting, 5)

    asyncio.run(main())
    blocked = [value for name, value in engine._observations if name == "rollout/backpressure_s"]
    assert blocked[0] == 0.0  # waiting for the server is not backpressure
    assert blocked[1] >= 0.05


def test_a_lost_server_drops_its_groups_as_server_lost_and_asks_the_trainer_once(monkeypatch, caplog):
    import threading

    from grpo_agent.sampler.errors import SamplerError

    engine, put = make_engine()
    engine.channels.server_down = threading.Event()

    async def rollout(slot, group_id, took_slot, shared, calls):
        raise SamplerError("connection refused")

    monkeypatch.setattr(engine_module.recovery, "means_server_lost", _answers(True))
    monkeypatch.setattr(engine, "_run_rollout", rollout)
    engine._groups_in_flight = engine._groups_generating = 2  # both dispatched, generating
    asyncio.run(engine._run_group(PromptSlot(0, 4, 0, {}), 0))
    asyncio.run(engine._run_group(PromptSlot(1, 5, 0, {}), 1))
    assert put == [PromptConsumed(0, 4, "server_lost"), PromptConsumed(1, 5, "server_lost")]
    assert engine.channels.server_down.is_set() and engine._groups_in_flight == 0
    # A dropped group stops generating too: the stall report must not count it on for good.
    context = engine.stall_context()
    assert context["groups_generating"] == 0 and context["groups_awaiting_score"] == 0
    assert engine._observations.count(("rollout/server_lost_group_count", 1.0)) == 2
    assert caplog.text.count("Lost the vLLM server") == 1


def test_a_lost_servers_warning_gives_the_reason_and_a_stopping_run_keeps_the_advice(
        monkeypatch, caplog):
    """While the trainer restores a lost server, "Start one ... or pass the right URL" is
    wrong: the worker's warning gave the client's whole message. It gives
    the one-line reason now; with no trainer to restore it the run stops with the advice."""
    import threading

    from grpo_agent.sampler.errors import exhausted_error

    refused = exhausted_error("POST", "http://x", "/inference/v1/generate",
                              "ConnectError: [Errno 111] Connection refused", 3)

    async def rollout(slot, group_id, took_slot, shared, calls):
        raise refused

    monkeypatch.setattr(engine_module.recovery, "means_server_lost", _answers(True))
    engine, _ = make_engine()
    engine.channels.server_down = threading.Event()
    monkeypatch.setattr(engine, "_run_rollout", rollout)
    engine._groups_in_flight = engine._groups_generating = 1
    with caplog.at_level("WARNING", logger=engine_module.__name__):
        asyncio.run(engine._run_group(PromptSlot(0, 4, 0, {}), 0))
    assert caplog.messages == [(
        "Lost the vLLM server at http://x (No vLLM server answered at http://x (ConnectError: "
        "[Errno 111] Connection refused) after 3 attempts); the groups in flight are dropped "
        "and counted, and new ones wait until the trainer restores it.")]

    engine, _ = make_engine()  # no trainer restores it (server_down is None): the run stops
    monkeypatch.setattr(engine, "_run_rollout", rollout)
    engine._groups_in_flight = engine._groups_generating = 1
    with pytest.raises(type(refused), match=r"after 3 attempts\. Start one with the flags"):
        asyncio.run(engine._run_group(PromptSlot(0, 4, 0, {}), 0))


def _answers(value):
    async def answer(error, base_url):
        return value
    return answer


def test_the_stages_of_a_groups_rollouts_belong_to_that_group(monkeypatch, tmp_path):
    """The stall watch reports a group's late rollouts once (`stall.set_group`): every stage a
    rollout of `_run_group` opens carries the group's id."""
    import threading

    from grpo_agent import stall
    from grpo_agent.sampler.errors import SamplerError

    engine, _ = make_engine()
    engine.channels.server_down = threading.Event()
    watch = stall.StallWatch(SimpleNamespace(output_dir=str(tmp_path)), "worker")
    groups = []

    async def rollout(slot, group_id, took_slot, shared, calls):
        with watch.stage("env_reset", 60, recover=True) as entry:
            groups.append(entry.group)
        raise SamplerError("connection refused")  # ends the group quickly

    monkeypatch.setattr(engine_module.recovery, "means_server_lost", _answers(True))
    monkeypatch.setattr(engine, "_run_rollout", rollout)
    engine._groups_in_flight = engine._groups_generating = 1
    asyncio.run(engine._run_group(PromptSlot(0, 4, 0, {}), 17))
    assert groups == [17, 17]


def test_the_server_is_first_read_one_poll_interval_after_the_start(monkeypatch):
    """A read at the start came before the first request: the idle server's zeros went into
    every run's first window (runs read `rollout/vllm_running_requests` 0 throughout)."""
    reads = []

    async def metrics():
        reads.append(time.monotonic())
        raise asyncio.CancelledError

    sampler = SimpleNamespace(metrics=metrics, base_url="http://x")
    engine, _ = make_engine(sampler=sampler)
    engine.cap = SimpleNamespace(update=lambda metrics, completed: None, value=4)
    monkeypatch.setattr(engine_module, "POLL_INTERVAL_S", 0.3)

    async def main():
        began = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await engine._poll_server()
        return began

    began = asyncio.run(main())
    assert len(reads) == 1 and reads[0] - began >= 0.3
    # the starting cap (the server's facts) is recorded at once, the gauges only once read
    assert engine._observations == [("rollout/concurrency_cap", 4)]


def test_preemptions_and_retries_are_logged_as_counts_since_the_last_look(monkeypatch):
    polls = iter([SimpleNamespace(kv_cache_usage=0.5, running=2, waiting=0, preemptions=5),
                  SimpleNamespace(kv_cache_usage=0.5, running=2, waiting=0, preemptions=8)])

    async def metrics():
        try:
            return next(polls)
        except StopIteration:
            raise asyncio.CancelledError from None

    sampler = SimpleNamespace(metrics=metrics, base_url="http://x", retry_count=2)
    engine, _ = make_engine(sampler=sampler)
    engine.cap = SimpleNamespace(update=lambda metrics, completed: None, value=4)
    monkeypatch.setattr(engine_module, "POLL_INTERVAL_S", 0)

    async def main():
        with pytest.raises(asyncio.CancelledError):
            await engine._poll_server()

    asyncio.run(main())
    assert [v for n, v in engine._observations if n == "rollout/vllm_preemption_count"] == [3.0]
    engine._record_progress()
    sampler.retry_count = 5
    engine._record_progress()
    assert [v for n, v in engine._observations if n == "rollout/vllm_retry_count"] == [2.0, 3.0]


def test_a_failing_metrics_poll_is_logged_once_per_outage(monkeypatch, caplog):
    """While the server is down (a managed restart took 158 s in a hand-run train) every 5 s
    poll fails: one warning per outage, not one per poll (that run logged 14)."""
    from grpo_agent.sampler.errors import SamplerError

    answers = iter(["down", "down", "down", "up", "down", "down"])
    gauges = SimpleNamespace(kv_cache_usage=0.5, running=2, waiting=0, preemptions=0)

    async def metrics():
        answer = next(answers, None)
        if answer is None:
            raise asyncio.CancelledError
        if answer == "down":
            raise SamplerError("No vLLM server answered at http://x")
        return gauges

    engine, _ = make_engine(sampler=SimpleNamespace(metrics=metrics, base_url="http://x"))
    engine.cap = SimpleNamespace(update=lambda metrics, completed: None, value=4)
    monkeypatch.setattr(engine_module, "POLL_INTERVAL_S", 0)

    async def main():
        with pytest.raises(asyncio.CancelledError):
            await engine._poll_server()

    with caplog.at_level("WARNING", logger=engine_module.__name__):
        asyncio.run(main())
    assert caplog.text.count("Polling http://x/metrics failed") == 2  # two outages


def test_stopping_the_pipeline_cancels_the_groups_still_running(monkeypatch):
    """When the trainer stops the worker, every group task still generating is cancelled and
    awaited before the pipeline returns (none is left running on the loop)."""
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(4)]
    engine, _ = make_engine(num_generations=2, dataset=rows, dataset_start_index=0,
                            filter_prompt=lambda index, row, epoch: True)
    started, cancelled = [], []
    stop = None

    async def run_group(slot, group_id):
        started.append(group_id)
        if len(started) == 2:
            stop.set()  # the trainer stops while both groups generate
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(group_id)
            raise

    async def forever():
        await asyncio.Event().wait()

    rooms = []

    async def wait_for_room():
        rooms.append(1)
        if len(rooms) > 2:
            await forever()  # no room for a third group
        await asyncio.sleep(0)

    async def wait_for_stop():
        await stop.wait()

    for name in ("_score_forever", "_poll_server", "_heartbeat", "_flush_metrics"):
        monkeypatch.setattr(engine, name, forever)
    monkeypatch.setattr(engine, "_run_group", run_group)
    monkeypatch.setattr(engine, "_wait_for_room", wait_for_room)
    monkeypatch.setattr(engine, "_wait_for_stop", wait_for_stop)
    monkeypatch.setattr(engine, "_send_last_observations", lambda: None)

    async def main():
        nonlocal stop
        stop = asyncio.Event()
        engine._fatal = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(engine._run_pipeline(), timeout=10)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []
    assert started == [0, 1] and sorted(cancelled) == [0, 1]


def test_a_cancelled_group_ends_only_after_every_rollout_has(monkeypatch):
    """At a worker's shutdown a group is cancelled; gather ends at its first cancelled rollout,
    so a rollout still cleaning up (a command agent being reaped) would outlive its group, and
    the event loop closed under it ("Loop ... that handles pid N is closed")."""
    cleaned = []

    async def rollout(slot, group_id, took_slot, shared):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if group_id == 1:  # the second needs a while to clean up, cancelled or not
                cleanup = asyncio.ensure_future(asyncio.sleep(0.05))
                while not cleanup.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(cleanup)
                cleaned.append(group_id)
            raise

    async def main():
        engine, _ = make_engine()
        numbers = iter([0, 1])
        monkeypatch.setattr(engine, "_run_rollout", lambda slot, group_id, took, shared, calls:
                            rollout(slot, next(numbers), took, shared))
        engine._groups_in_flight = engine._groups_generating = 1
        group = asyncio.create_task(engine._run_group(PromptSlot(0, 0, 0, {}), 0))
        await asyncio.sleep(0.01)
        group.cancel()
        await asyncio.gather(group, return_exceptions=True)
        return list(cleaned)

    assert asyncio.run(main()) == [1]
