"""The stall watch on its own: a hung stage is named in stall_report.json with its stacks, a
recoverable one raises `StageStalled` in its owner, a fatal one exits the process with code 3,
and the no-progress guard stops a run whose groups are all dropped."""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from grpo_agent import stall
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train import no_progress

sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import record_fault_to_outcome


def _config(tmp_path, **kwargs):
    return AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_deadlines_are_derived_from_the_config_or_set_explicitly(tmp_path):
    config = _config(tmp_path, vllm_server_timeout=100, rollout_worker_timeout=20,
                     stall_timeouts={"weight_sync": 7, "scoring": 3})
    assert stall.stage_deadline(config, "scoring") == 3
    assert stall.stage_deadline(config, "weight_sync/transfer") == 7  # the family's deadline
    assert stall.stage_deadline(config, "queue_pull") == 120
    assert stall.stage_deadline(config, "vllm_generate") == 100 + stall.OWN_TIMEOUT_MARGIN_S
    with pytest.raises(ValueError, match="unknown stage 'scorng'"):
        _config(tmp_path, stall_timeouts={"scorng": 3})
    with pytest.raises(ValueError, match="must be a number of seconds > 0"):
        _config(tmp_path, stall_timeouts={"scoring": 0})
    # Not a number: the field is named (float's own error was "could not convert string to
    # float: 'abc'" from `grpo-agent train --set 'stall_timeouts={"scoring": "abc"}'`).
    for value in ("abc", None, [3], True):  # true is no number of seconds, though float() reads 1
        with pytest.raises(ValueError, match=r"stall_timeouts\['scoring'\]=.*number of seconds"):
            _config(tmp_path, stall_timeouts={"scoring": value})


def test_each_derived_deadline_follows_the_timeout_its_stage_uses(tmp_path):
    """Without stall_timeouts each stage's deadline comes from the timeout that bounds it: a
    stage that enforces a timeout itself (a tool call, a generate request, a weight push) gets
    OWN_TIMEOUT_MARGIN_S on top, so its own clearer error comes first; an env's reset and
    reward are bounded by the tool timeout (not the worker's); scoring by the worker's."""
    server, worker, tool = 100, 20, 7  # distinct, so a stage on the wrong timeout shows
    config = _config(tmp_path, vllm_server_timeout=server, rollout_worker_timeout=worker,
                     tool_timeout_s=tool)
    margin = stall.OWN_TIMEOUT_MARGIN_S
    expected = {
        "tool": tool + margin,
        "env_reset": tool,
        "env_finish": tool,
        "scoring": worker,
        "vllm_generate": server + margin,
        "queue_pull": server + worker,
        "weight_sync": server + margin,
        "weight_sync/transfer": server + margin,  # a family member: the family's rule
        "checkpoint_save": server,
        "server_restore": max(server, stall.SERVER_STARTUP_TIMEOUT_S) + margin,
        "collective": stall.COLLECTIVE_DEADLINE_S,
    }
    assert {name: stall.stage_deadline(config, name) for name in expected} == expected
    # An explicit deadline for one stage leaves the others derived.
    explicit = _config(tmp_path, tool_timeout_s=tool, stall_timeouts={"tool": 5})
    assert stall.stage_deadline(explicit, "tool") == 5
    assert stall.stage_deadline(explicit, "env_reset") == stall.stage_deadline(explicit, "env_finish") == tool
    with pytest.raises(KeyError, match="Unknown stall stage 'tools'"):
        stall.stage_deadline(config, "tools")


def test_collective_phase_deadlines_and_the_process_group_timeout(tmp_path):
    """A phase waits the collective deadline plus what rank 0 may spend in it; the process
    group (ddp_timeout) outwaits every phase, so the stall report comes first."""
    config = _config(tmp_path, vllm_server_timeout=100, rollout_worker_timeout=20,
                     stall_timeouts={"collective": 4}, ddp_timeout=60)
    assert stall.collective_deadline(config, "train step") == 4
    assert stall.collective_deadline(config, "step plan") == 4 + 120  # + queue_pull
    assert stall.collective_deadline(config, "weight push") == 4 + 100 + stall.OWN_TIMEOUT_MARGIN_S
    # Rank 0 restarting a managed server may take its startup_timeout (600 s), past
    # vllm_server_timeout: the phase outwaits it (a restart at load 14 took over 190 s).
    restart = stall.SERVER_STARTUP_TIMEOUT_S + stall.OWN_TIMEOUT_MARGIN_S
    assert stall.collective_deadline(config, "server restore") == 4 + restart
    assert config.ddp_timeout == 4 + restart + stall.OWN_TIMEOUT_MARGIN_S  # raised: longest + 60 s
    assert _config(tmp_path).ddp_timeout == 1800 + 2100 + stall.PROCESS_GROUP_MARGIN_S
    assert _config(tmp_path, ddp_timeout=10_000).ddp_timeout == 10_000  # a longer one stays


def hung_reward_in_a_thread(release: threading.Event) -> None:
    release.wait()


def test_a_recoverable_stage_is_reported_with_stacks_and_cancelled(tmp_path, record_property):
    watch = stall.StallWatch(_config(tmp_path), "worker", context=lambda: {"queue": 5}).start()
    release = threading.Event()
    executor = ThreadPoolExecutor(1)  # not asyncio's default one: asyncio.run would wait for it

    async def owner():
        loop = asyncio.get_running_loop()
        with watch.stage("scoring", 0.5, recover=True, group_id=7):
            await loop.run_in_executor(executor, hung_reward_in_a_thread, release)

    started = time.monotonic()
    try:
        with pytest.raises(stall.StageStalled, match="stage 'scoring' \\(group_id=7\\)"):
            asyncio.run(owner())
        record_fault_to_outcome(record_property, time.monotonic() - started, 0.5)
    finally:
        release.set()
        executor.shutdown(wait=False)
        watch.stop()
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["stage"] == "scoring" and report["group_id"] == 7
    assert report["elapsed_s"] >= 0.5 and report["action"] == "cancelled and counted"
    assert report["context"] == {"queue": 5}
    assert "hung_reward_in_a_thread" in report["stacks"]["worker"]  # the culprit's frame
    assert not watch.in_flight()


def test_the_late_rollouts_of_one_group_are_reported_once(tmp_path):
    """Every rollout of a group (the engine's `_run_group`: `set_group`, then one task per
    rollout) hangs in its env reset and passes the deadline in the same check: the first is
    reported and cancelled, which drops the group; its siblings are not reported again. A
    stage of another group still is. (Each report used to come twice, in a hand-run train
    whose env reset always hung: the second before the event loop had run the first's cancel.)"""
    watch = stall.StallWatch(_config(tmp_path), "worker")  # no monitor: the test calls check()
    dropped = []

    async def rollout():
        with watch.stage("env_reset", 0.2, recover=True):
            await asyncio.Event().wait()

    async def group(group_id):
        stall.set_group(group_id)
        rollouts = [asyncio.ensure_future(rollout()) for _ in range(3)]
        try:
            await asyncio.gather(*rollouts)
        except stall.StageStalled:
            for task in rollouts:
                task.cancel()
            await asyncio.gather(*rollouts, return_exceptions=True)
            dropped.append(group_id)

    async def two_groups():
        await asyncio.gather(group(1), group(2))

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(two_groups(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while len(watch.in_flight()) < 6 and time.monotonic() < deadline:  # every stage open
        time.sleep(0.01)
    time.sleep(0.3)
    loop.call_soon_threadsafe(time.sleep, 1.0)  # a busy loop: no cancel runs during the check
    try:
        watch.check()
        thread.join(5)
    finally:
        watch.stop()
    assert sorted(dropped) == [1, 2]
    assert [report["stage"] for report in watch.stalls] == ["env_reset", "env_reset"]
    assert not watch.in_flight()


def test_a_cancel_that_lands_after_its_stage_ended_cancels_nothing(tmp_path):
    """The monitor cancels a late stage's task from its own thread; when the stage ends before
    the event loop runs that cancel, the task has moved on and must not be cancelled."""
    watch = stall.StallWatch(_config(tmp_path), "worker")

    async def cancel_lands_late():
        with watch.stage("scoring", 60, recover=True) as entry:
            pass
        entry.cancel()  # what the monitor schedules, run by the loop after the stage ended
        await asyncio.sleep(0.05)  # the task's next work
        return "finished"

    async def cancel_lands_in_time():
        with watch.stage("scoring", 60, recover=True) as entry:
            entry.cancel()
            await asyncio.sleep(5)

    assert asyncio.run(cancel_lands_late()) == "finished"
    with pytest.raises(asyncio.CancelledError):  # not reported stalled: a plain cancel
        asyncio.run(cancel_lands_in_time())
    assert not watch.in_flight()


def test_a_stage_that_ends_in_time_reports_nothing(tmp_path):
    watch = stall.StallWatch(_config(tmp_path), "trainer").start()
    try:
        with watch.stage("checkpoint_save", 5.0):
            time.sleep(0.1)
        time.sleep(1.5)
    finally:
        watch.stop()
    assert not (tmp_path / stall.REPORT_NAME).exists() and not watch.stalls


def test_a_fatal_stage_writes_the_report_and_exits_with_the_stall_code(tmp_path, record_property):
    script = textwrap.dedent(f"""
        import time
        from grpo_agent import stall
        from grpo_agent.config import AsyncGRPOConfig
        stall.ABORT_GRACE_S = 1.0
        config = AsyncGRPOConfig(output_dir={str(tmp_path)!r}, use_cpu=True, report_to="none",
                                 stall_timeouts={{"weight_sync": 1}})
        stall.StallWatch(config, "trainer").start()
        stall.on_abort(lambda: open({str(tmp_path / "aborted")!r}, "w").close())
        def transfer_that_never_returns():
            time.sleep(600)
        open({str(tmp_path / "hung-at")!r}, "w").write(str(time.time()))
        with stall.stage("weight_sync/transfer", version=3):
            transfer_that_never_returns()
    """)
    (tmp_path / "hang.py").write_text(script)
    result = subprocess.run([sys.executable, str(tmp_path / "hang.py")], check=False, capture_output=True,
                            text=True, timeout=120)
    # The outcome is the exit: the deadline (1 s), then the grace for a blocked stage (1 s).
    record_fault_to_outcome(record_property, time.time() - float((tmp_path / "hung-at").read_text()),
                            1.0 + 1.0)
    assert result.returncode == stall.STALL_EXIT_CODE, result.stderr[-2000:]
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["stage"] == "weight_sync/transfer" and report["version"] == 3
    assert report["action"] == "stopping the run"
    assert "transfer_that_never_returns" in report["stacks"]["trainer"]
    assert (tmp_path / "aborted").exists()  # the abort callbacks ran first
    assert "STALL in the trainer: stage 'weight_sync/transfer'" in result.stderr


def test_no_progress_warns_with_the_cause_then_stops(tmp_path, caplog):
    watch = stall.StallWatch(_config(tmp_path), "trainer").start()
    guard = no_progress.NoProgressGuard(timeout_s=1.0, watch=watch)
    try:
        for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS - 1):
            guard.record("zero_std")
        guard.record("filtered")  # a filtered prompt is neither progress nor a dropped group
        with caplog.at_level(logging.WARNING, logger="grpo_agent.stall"):
            guard.check()
            assert "No progress" not in caplog.text  # the window is not full yet
            guard.record("zero_std")
            guard.check()
        assert "never produces reward variance" in caplog.text
        guard.record(None)  # a trainable sample resets the window
        guard.check()
        for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
            guard.record("reward_error")
        time.sleep(1.1)
        with caplog.at_level(logging.ERROR, logger="grpo_agent.stall"), \
                pytest.raises(stall.StageStalled, match="no_progress_timeout=1 s") as raised:
            guard.check()
        assert str(raised.value).endswith(f"See {tmp_path / stall.REPORT_NAME}.")
        # The log's advice names the setting that exists: stall_timeouts has no 'no_progress'.
        assert "Raise no_progress_timeout if it is only slow" in caplog.text
        assert "stall_timeouts['no_progress']" not in caplog.text
    finally:
        watch.stop()
    report = json.loads((tmp_path / stall.REPORT_NAME).read_text())
    assert report["stage"] == "no_progress" and report["dropped_groups"] == {"reward_error": 8}
    assert "reward functions fail" in report["cause"]


def test_no_progress_without_a_stall_watch_still_stops():
    guard = no_progress.NoProgressGuard(timeout_s=5, watch=None)
    for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
        guard.record("stalled")
    guard.last_progress -= 10
    with pytest.raises(stall.StageStalled, match=r"8 stalled\) .*no_progress_timeout=5 s.*without bound\)\.$"):
        guard.check()


def test_no_progress_timeout_zero_only_warns(tmp_path):
    guard = no_progress.NoProgressGuard(timeout_s=0, watch=None)
    for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
        guard.record("stalled")
    guard.last_progress -= 10_000
    guard.check()  # no raise


def test_a_trainable_sample_restarts_the_no_progress_clock_and_the_warning(caplog):
    guard = no_progress.NoProgressGuard(timeout_s=600, watch=None)
    guard.last_progress -= 10_000  # long idle before the sample below
    guard.record(None)
    with caplog.at_level(logging.WARNING, logger="grpo_agent.train.no_progress"):
        for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
            guard.record("stalled")
        guard.check()  # no raise: the last trainable sample came just now
        assert caplog.text.count("No progress") == 1  # the run's first streak warns at once
        assert "rollouts pass their stage deadlines" in caplog.text
        guard.record(None)
        for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
            guard.record("stalled")
        guard.check()  # no raise either, and no new warning yet
        guard.last_progress -= no_progress.REWARN_IDLE_S
        guard.check()
        assert caplog.text.count("No progress") == 2  # a later streak warns once idle long enough


def test_a_run_that_trains_between_dropped_windows_warns_once(caplog):
    """make demo-words nearing saturation: a trainable sample every few dropped groups, steps
    going on. It logged 'No progress ... for 0 s' 12 times in 45 s; one warning is the cause."""
    guard = no_progress.NoProgressGuard(timeout_s=1800, watch=None)
    with caplog.at_level(logging.WARNING, logger="grpo_agent.train.no_progress"):
        for _ in range(12):
            for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
                guard.record("zero_std")
            guard.check()
            guard.record(None)
    assert caplog.text.count("No progress") == 1


def test_the_first_warning_of_a_run_that_never_trained_says_so_instead_of_for_0_s(caplog):
    """The README's words run warned at once, as its first 8 groups were zero_std: "... and no
    trainable sample came for 0 s", then trained. Before a first trainable sample the warning
    says none has been trainable yet; after one, how long ago it came."""
    guard = no_progress.NoProgressGuard(timeout_s=1800, watch=None)
    with caplog.at_level(logging.WARNING, logger="grpo_agent.train.no_progress"):
        for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
            guard.record("zero_std")
        guard.check()
    assert ("the last 8 groups were all dropped (8 zero_std) and none of the run's groups has "
            "been trainable yet. Likely cause") in caplog.text, caplog.text
    assert "came for" not in caplog.text
    guard.record(None)
    for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
        guard.record("zero_std")
    guard.last_progress -= 90
    assert "and no trainable sample came for 90 s. Likely cause" in guard.cause(90.0)


def _watch_with_a_peer(tmp_path, role, peer_role):
    """This process's watch (not started) and a real peer process whose watch dumps its stacks."""
    peer_dir = tmp_path / "run"
    script = textwrap.dedent(f"""
        import sys, time, types
        from grpo_agent import stall
        stall.StallWatch(types.SimpleNamespace(output_dir={str(peer_dir)!r}), {peer_role!r}).start()
        def peer_waits_here():
            print("ready", flush=True)
            time.sleep(60)
        peer_waits_here()
    """)
    peer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert peer.stdout.readline() == "ready\n"
    watch = stall.StallWatch(_config(peer_dir), role, context=lambda: 1 / 0)
    watch.peer_pid = peer.pid
    return watch, peer


def test_a_report_names_the_peers_stacks_by_role_and_holds_only_the_latest_dump(tmp_path):
    """The worker's report carries the trainer's stacks under "trainer", read from where this
    request's dump starts (an earlier dump in the same file is not repeated); a context that
    fails still leaves a report."""
    from grpo_agent import stall_report

    watch, peer = _watch_with_a_peer(tmp_path, "worker", "trainer")
    try:
        with watch.stage("scoring", 60, report_extra=lambda: {"version": 3}) as entry:
            first = stall_report.write(watch, entry, {"extra": 1})
            second = stall_report.write(watch, entry, {})
    finally:
        peer.kill()
        peer.wait()
    assert set(first["stacks"]) == {"worker", "trainer"}
    assert "peer_waits_here" in first["stacks"]["trainer"]
    assert "test_a_report_names_the_peers_stacks" in first["stacks"]["worker"]
    assert second["stacks"]["trainer"].count("peer_waits_here") == first["stacks"]["trainer"].count("peer_waits_here") == 1
    assert first["context"]["error"].startswith("context unavailable: ZeroDivisionError")
    assert (first["version"], first["extra"], first["action"]) == (3, 1, "stopping the run")
    assert json.loads((watch.output_dir / stall.REPORT_NAME).read_text())["pid"] == second["pid"]


def test_a_peer_that_watches_no_stages_is_not_signalled(tmp_path):
    """SIGUSR2 kills a process without the faulthandler hook: no stack file, no signal."""
    from grpo_agent import stall_report

    bystander = subprocess.Popen(["sleep", "60"])
    try:
        stacks = stall_report.stacks_of(lambda role: tmp_path / f"stacks-{role}.txt", {"worker": bystander.pid})
        assert stacks == {"worker": "(that process watches no stages: no stack dump)"}
        time.sleep(0.2)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_recoverable_stage_reports_the_await_chain_of_its_task(tmp_path):
    from grpo_agent import stall_report

    watch = stall.StallWatch(_config(tmp_path), "worker")

    async def owner_awaiting_the_reward():
        with watch.stage("scoring", 60, recover=True) as entry:
            return await asyncio.to_thread(stall_report.write, watch, entry, {})

    report = asyncio.run(owner_awaiting_the_reward())
    assert "in owner_awaiting_the_reward" in report["stage_stack"]
    assert report["action"] == "cancelled and counted"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_progress_names_temperature_zero_as_the_likely_cause(caplog, temperature):
    # temperature=0 on a deterministic env: every group's rollouts are one greedy completion,
    # every group dropped as zero_std until no_progress_timeout (1800 s), whose message sent
    # the user to the rewards and prompts instead.
    guard = no_progress.NoProgressGuard(timeout_s=5, watch=None, temperature=temperature)
    for _ in range(no_progress.NO_PROGRESS_WINDOW_GROUPS):
        guard.record("zero_std")
    guard.last_progress -= 10
    with caplog.at_level(logging.WARNING, logger="grpo_agent.train.no_progress"), \
            pytest.raises(stall.StageStalled) as raised:
        guard.check()
    greedy = "Likely cause: temperature=0 samples greedily"
    for text in (caplog.text, str(raised.value)):
        assert (greedy in text) == (temperature == 0)
        assert ("never produces reward variance" in text) == (temperature != 0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_greedy_sampling_is_warned_at_the_start_of_a_training_run(caplog, temperature):
    from types import SimpleNamespace

    from grpo_agent.train.trainer import AsyncGRPOTrainer

    # A stand-in trainer whose args lack output_dir: train() stops right after its start checks.
    stub = SimpleNamespace(args=SimpleNamespace(temperature=temperature))
    with caplog.at_level(logging.WARNING, logger="grpo_agent.train.trainer"), \
            pytest.raises(AttributeError, match="output_dir"):
        AsyncGRPOTrainer.train(stub)
    assert ("Training at temperature=0 samples greedily" in caplog.text) == (temperature == 0)
    if temperature == 0:
        assert "no_progress_timeout" in caplog.text
