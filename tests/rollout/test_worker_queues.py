"""The trainer's side of the worker's queues when the worker dies mid-message (no server)."""
import threading
import time
from types import SimpleNamespace

import pytest
import rollout_test_helpers as helpers
from grpo_agent.rollout.worker import RolloutWorker, RolloutWorkerError


def _finishes_within(seconds: float, action) -> bool:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_a_truncated_message_neither_hangs_the_metrics_drain_nor_the_next_pull():
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0)
    worker = RolloutWorker(helpers.DiesMidMessageLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    worker.start()
    time.sleep(1.0)  # the child has written half a message and exited
    try:
        assert _finishes_within(20, worker.drain_metrics)  # EOF, not a read that never returns
        with pytest.raises(RolloutWorkerError, match="exited with code 0 without reporting an error: it failed while starting .*traceback is on stderr above"):
            worker.pull(timeout=5.0)
    finally:
        assert _finishes_within(30, worker.stop)


def test_a_worker_failure_is_named_by_its_exception_not_by_a_traceback_line(tmp_path):
    """The CLI's one line (`report_failure`) for a worker whose error message carries a
    traceback of its own names that error and its reason; it used to give only the inner
    traceback's last line (`ValueError: judge is down`, no word of the reward function)."""
    from grpo_agent.cli.failure import report_failure

    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0)
    worker = RolloutWorker(helpers.RewardKeepsRaisingLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    try:
        with pytest.raises(RolloutWorkerError) as raised:
            worker.start()  # it fails at once: seen here or at the pull
            worker.pull(timeout=30.0)
    finally:
        assert _finishes_within(30, worker.stop)
    message, code = report_failure(raised.value, tmp_path)
    assert message.splitlines()[0] == (
        "Error: the run failed: RolloutWorkerError: The rollout worker failed: RewardFunctionError: "
        "Reward function 'judge' raised on 10 groups in a row, so the run stops. Its last "
        "traceback: ValueError: judge is down")
    assert code == 1
    assert "in run\n" in (tmp_path / "error.log").read_text()  # the worker's traceback, in full


def test_a_worker_frozen_mid_message_is_called_hung_not_waited_for():
    """A worker SIGSTOPped while it wrote a sample: the trainer's read of the half-written
    message blocks where its heartbeat check cannot run. Past rollout_worker_timeout the pull
    fails as for any hung worker (it used to wait until the queue_pull stall, 30 min by default)."""
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=2.0, seed=0)
    worker = RolloutWorker(helpers.FreezesMidSampleLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    worker.start()
    failure = []

    def pull():
        try:
            worker.pull(timeout=60.0)
        except RolloutWorkerError as error:
            failure.append(str(error))

    try:
        started = time.monotonic()
        assert _finishes_within(30, pull), "the pull waited for the frozen worker's message"
        assert failure and "it is hung" in failure[0], failure
        assert time.monotonic() - started < 2.0 + 15  # the timeout, the margin, a tick, the kill
    finally:
        assert _finishes_within(30, worker.stop)


def test_the_last_metrics_arrive_when_the_trainer_finishes_the_worker_before_it_exits():
    """The run's last step stops the worker (`finish`, instead of sleeping through its flush
    interval): the observation comes back with the engine's last message, before the worker's
    slow exit."""
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0)
    worker = RolloutWorker(helpers.ObservesOnceLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    worker.start()
    try:
        started = time.monotonic()
        assert worker.finish(timeout_s=30.0)
        assert time.monotonic() - started < 30
        assert ("test/observed_once", 1.0) in worker.drain_metrics()
    finally:
        assert _finishes_within(30, lambda: worker.stop(grace_s=0.0))


def test_the_observations_sent_as_the_worker_stops_reach_the_trainer():
    """The engine's last flush happens as the worker returns; the child must write it to the
    pipe before it exits: with the metrics queue's feeder thread not joined, a batch it had not
    written yet was lost (a run's last observations, dropped now and then on a loaded machine)."""
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0)
    worker = RolloutWorker(helpers.ObservesAsItStopsLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    worker.start()
    assert _finishes_within(60, worker.stop)
    assert ("test/last", 7.0) in worker.drain_metrics()
    assert worker._process.exitcode == 0  # it exited by itself, not by stop()'s SIGTERM


def test_the_hung_error_names_what_most_likely_blocks_the_loop():
    """A harness worker is most likely blocked by its agent (a sync client in an async agent
    hangs the loop its gateway runs on): the error says so, not "reward/tool/environment"."""
    import functools

    from grpo_agent.rollout.harness import HarnessRolloutLoop

    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=1.5, seed=0)
    harness = RolloutWorker(functools.partial(HarnessRolloutLoop, agent="a:b"), config=config,
                            model_name="unused", dataset=[], reward_funcs=[], processing_class=None)
    assert "sync openai.OpenAI client" in harness._hang_suspects()
    # ...and the hung error itself says it (its process is not started: only the rule runs).
    harness._check_alive, harness.stop = lambda: None, lambda grace_s=None: None
    harness.channels.heartbeat.value = 0.0  # last beat long ago
    with pytest.raises(RolloutWorkerError, match="it is hung. Check the vLLM server and an "
                       "async agent that blocks the worker's event loop"):
        harness._check_health()
    plain = RolloutWorker(helpers.HangsAfterFirstBeatLoop, config=config, model_name="unused",
                          dataset=[], reward_funcs=[], processing_class=None)
    assert plain._hang_suspects() == "any blocking reward/tool/environment code"


def test_a_worker_that_stops_beating_is_called_hung_and_killed():
    """rollout_worker_timeout: a worker alive but silent past it fails the trainer's next pull
    with the advice, and is killed (it ignores the stop event), instead of a silent wait."""
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=1.5, seed=0)
    worker = RolloutWorker(helpers.HangsAfterFirstBeatLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    worker.start()
    try:
        started = time.monotonic()
        with pytest.raises(RolloutWorkerError, match=r"sent no heartbeat for \d+ s "
                           r"\(rollout_worker_timeout=1.5 s\): it is hung.*raise rollout_worker_timeout"):
            worker.pull(timeout=60.0)
        assert time.monotonic() - started < 30  # the deadline, not the pull's own timeout
        worker._process.join(5)
        assert not worker._process.is_alive()  # killed: it would never have stopped itself
    finally:
        assert _finishes_within(30, worker.stop)


def test_a_terminated_worker_leaves_no_stack_file_in_the_output_dir(tmp_path):
    """A SIGTERMed `grpo-agent train` left stacks-worker.txt beside its checkpoints: the worker
    is terminated, so its stall watch never deletes the file; stop() now does."""
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60, seed=0, output_dir=str(tmp_path))
    worker = RolloutWorker(helpers.WatchedThenHangsLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    worker.start()
    assert (tmp_path / "stacks-worker.txt").exists()
    assert _finishes_within(30, lambda: worker.stop(grace_s=0.0))
    assert worker._process.exitcode == -15  # ended by stop()'s SIGTERM, not by itself
    assert not (tmp_path / "stacks-worker.txt").exists()


def test_the_server_down_flag_goes_from_the_worker_to_the_trainer_and_back():
    """The child's engine raises `server_down` when it loses the server; the trainer's pull loop
    asks `worker.server_down` (through getattr with a default, so a worker without the flag
    would never have its server restored) and clears it once the server is back."""
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0)
    worker = RolloutWorker(helpers.LosesTheServerLoop, config=config, model_name="unused",
                           dataset=[], reward_funcs=[], processing_class=None)
    assert worker.server_down is False
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not worker.server_down and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.server_down
        worker.server_restored()
        deadline = time.monotonic() + 30
        observations = []
        while ("test/dispatched_again", 1.0) not in observations and time.monotonic() < deadline:
            observations += worker.drain_metrics()
            time.sleep(0.05)
        assert ("test/dispatched_again", 1.0) in observations
    finally:
        assert _finishes_within(30, worker.stop)


def _errors_of_one_pull(loop) -> list[Exception]:
    """A worker on `loop` pulled once: the pull must end within 30 s (not hang), and so must
    the stop; returns what the pull raised."""
    config = SimpleNamespace(max_staleness=1, token_budget=64, gradient_accumulation_steps=1,
                             rollout_worker_timeout=60.0, seed=0)
    worker = RolloutWorker(loop, config=config, model_name="unused", dataset=[], reward_funcs=[],
                           processing_class=None)
    worker.start()
    errors = []

    def pull():
        try:
            worker.pull(timeout=60.0)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            errors.append(error)

    try:
        assert _finishes_within(30, pull)
    finally:
        assert _finishes_within(30, worker.stop)
    return errors


def test_a_sample_cut_off_by_the_workers_death_breaks_the_pull_instead_of_hanging_it():
    """The trainer closes its copy of every queue's write end, the sample queue's too: a
    worker dying mid-message then leaves the pull reading it an EOF, not a read that never ends."""
    errors = _errors_of_one_pull(helpers.DiesMidSampleLoop)
    assert errors and all(isinstance(error, RolloutWorkerError) for error in errors), errors


def test_a_traceback_cut_off_by_the_workers_death_still_fails_the_pull_with_the_workers_error():
    """A worker killed while writing its traceback (after setting `failed`): the pull reports the
    worker failed, its traceback lost, instead of hanging on the message forever."""
    errors = _errors_of_one_pull(helpers.DiesMidTracebackLoop)
    assert len(errors) == 1 and isinstance(errors[0], RolloutWorkerError), errors
    assert "traceback was lost" in str(errors[0])
