"""`RolloutWorker`: the trainer's handle on the spawned rollout process.

Design decision: the worker is *spawned* (never forked: the trainer holds CUDA and threads)
with `CUDA_VISIBLE_DEVICES=""`, and shares only small things with the trainer, named in
`WorkerChannels`: the sample queue, the model version, a cumulative token allowance, a
heartbeat timestamp, a failure channel carrying the child's traceback and the stop request. The staleness rule (`rollout.allowance.TokenAllowance`) runs here, at
pull time: samples more than `max_staleness` versions old are dropped and counted. Every wait is bounded, and each `pull`
checks the child's health first, so a crashed, killed or hung worker surfaces in the trainer
within `rollout_worker_timeout` with the reason. `stop` is idempotent and leaves no process.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from typing_extensions import Self

from grpo_agent import stall
from grpo_agent.error_text import error_text
from grpo_agent.metrics import Observation
from grpo_agent.rollout.allowance import TokenAllowance, initial_step_tokens
from grpo_agent.rollout.channels import METRICS_FLUSHED, WorkerChannels
from grpo_agent.types import PromptConsumed, TrainingSample

STOP_GRACE_S = 15.0
# Spawning re-imports torch/transformers and unpickles the dataset: allow for a busy machine.
MIN_STARTUP_S = 120.0
PULL_POLL_S = 0.25
HUNG_READ_CHECK_S = 1.0  # how often a pull checks the heartbeat while a read may block
# Past rollout_worker_timeout by this much, the pull is blocked in a read (unblocked, it checks
# every PULL_POLL_S and stops the worker itself, politely): then its watch kills the worker.
HUNG_READ_MARGIN_S = 5.0
ORPHAN_POLL_S = 1.0
MAX_ITEMS_PER_PULL = 4096
_ENV_LOCK = threading.Lock()


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed, died or hung; the message carries the reason."""


class RolloutWorkerHung(RolloutWorkerError):
    """No heartbeat within rollout_worker_timeout: something blocks the worker (no traceback)."""


def exit_when_orphaned(parent: int, poll_s: float = ORPHAN_POLL_S) -> threading.Thread:
    """End this process when `parent` (the trainer, its pid passed in: it may die before we
    look) is no longer its parent. A trainer killed with SIGKILL (or SIGTERM outside the CLI)
    runs no clean-up, and its daemon worker would go on dispatching rollouts with nobody
    reading them; its own children (agents, episode servers) die with it in turn."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.write(2, f"grpo-agent rollout worker: trainer (pid {parent}) is gone; exiting.\n".encode())
        os._exit(1)

    thread = threading.Thread(target=watch, name="grpo-agent-orphan-watch", daemon=True)
    thread.start()
    return thread


def failure_text(error: BaseException) -> str:
    """What the worker sends back on failure: the exception with its whole message first, then
    the traceback. The CLI prints the first line (`cli/failure.py`); a traceback's last line
    alone lost the head of a message that carries a traceback of its own (a reward function
    that raised on 10 groups in a row was reported as the reward's `ValueError`)."""
    return f"{error_text(error)}\n{traceback.format_exc()}"


def _child_main(loop_cls, loop_kwargs: dict[str, Any], channels: WorkerChannels, trainer_pid: int) -> None:
    """Entry of the spawned process: build the loop, run it, report any failure.

    Ctrl-C is the trainer's to handle: a terminal sends SIGINT to the whole foreground group,
    and a worker that took it died with a traceback (while importing) or reported a failure of
    its own. It was spawned with SIGINT blocked (`start`): ignore it, then unblock, dropping
    one that came meanwhile. Its own children (the math-verify helper) inherit the ignoring."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    exit_when_orphaned(trainer_pid)
    try:
        loop_cls(**loop_kwargs, channels=channels).run()
    except BaseException as error:  # noqa: BLE001 - everything goes back to the trainer
        channels.error.put(failure_text(error))
        channels.failed.set()
        channels.samples.cancel_join_thread()
        raise SystemExit(1)
    # Unread samples must not keep this process alive after a stop: stop() discards them. The
    # metrics queue's feeder is joined at exit, so the engine's last flush reaches the trainer
    # (stop() reads the queue while it waits, and terminates the process after its grace).
    channels.samples.cancel_join_thread()


class RolloutWorker:
    """Starts, feeds, watches and stops one rollout worker process."""

    def __init__(self, loop_cls, *, config, model_name, dataset, reward_funcs, processing_class,
                 tools=None, environment_factory=None, dataset_start_index=0, lora_name=None,
                 token_budget: int | None = None):
        """`token_budget`: the tokens of one packed row, as the trainer resolved it (the config's,
        else the server's max_model_len); it sizes the allowance until the first step reports.
        Without one (a worker run alone), one group of full completions per row is assumed."""
        self.config = config
        self._context = mp.get_context("spawn")
        self.channels = WorkerChannels.create(self._context)
        row_tokens = (token_budget or config.token_budget
                      or config.max_completion_length * config.num_generations)
        self.allowance = TokenAllowance(config.max_staleness, self._full_step(row_tokens))
        self._publish_allowance()
        self._trainer_observations: list[Observation] = []
        self._process = None
        self._stopped = False
        self._killed_as_hung = False
        eos = getattr(processing_class, "eos_token_id", None)
        self._loop_kwargs = {
            "config": config, "model_name": model_name, "dataset": dataset, "reward_funcs": reward_funcs,
            "processing_class": processing_class, "eos_token_ids": [] if eos is None else [eos],
            "tools": tools, "environment_factory": environment_factory, "lora_name": lora_name,
            "dataset_start_index": dataset_start_index}
        self._loop_cls = loop_cls

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn the worker and wait for its first heartbeat; raises if it dies first."""
        self._process = self._context.Process(
            target=_child_main, args=(self._loop_cls, self._loop_kwargs, self.channels, os.getpid()),
            name="grpo-agent-rollout", daemon=True)
        with _ENV_LOCK:  # the child must never see the trainer's GPUs, even while importing
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            # The child inherits the mask: a Ctrl-C while it imports waits for `_child_main` to
            # ignore it. Ours stays pending until the unblock, not lost as with SIG_IGN here.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self._process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                _restore_env("CUDA_VISIBLE_DEVICES", saved)
        self._close_our_write_ends()
        startup_s = max(self.config.rollout_worker_timeout, MIN_STARTUP_S)
        deadline = time.monotonic() + startup_s
        while self.channels.heartbeat.value == 0.0:
            self._check_alive()
            if time.monotonic() > deadline:
                self.stop(grace_s=0.0)
                raise RolloutWorkerError(
                    f"The rollout worker did not start within {startup_s:.0f} s (importing the "
                    "loop, rewards and dataset in the spawned process hung or is very slow).")
            time.sleep(0.05)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ask the worker to stop, then terminate/kill it if it does not; idempotent."""
        if self._stopped or self._process is None:
            self._stopped = True
            return
        self._stopped = True
        self.channels.stop.set()
        process = self._process
        # A child exits only after flushing what it queued; with a long backlog that needs us to
        # read. Keep draining until it is gone: unread samples are discarded, metrics are kept.
        deadline = time.monotonic() + grace_s
        while process.is_alive() and time.monotonic() < deadline:
            self._discard_queued_samples()
            self._trainer_observations += self._read_metrics_queue()
            process.join(0.05)
        if process.is_alive():
            process.terminate()
            # A frozen worker (SIGSTOP) keeps SIGTERM pending until it runs again: without this,
            # stopping it waited the whole join below and then killed it (5 s more per hang).
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        if not process.is_alive():
            # A terminated worker (SIGTERM to the run, a hung one) never ran its watch's stop, so
            # its faulthandler file, stacks-worker.txt, stayed in the output dir of a finished run.
            with contextlib.suppress(OSError):
                stall.stack_file(stall.watch_folder(self.config), "worker").unlink()
        self._trainer_observations += self._read_metrics_queue()  # keep them for drain_metrics
        for channel in self.channels.queues:
            channel.cancel_join_thread()
            channel.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ------------------------------------------------------------------ trainer side

    def set_model_version(self, version: int) -> None:
        self.channels.model_version.value = int(version)

    @property
    def model_version(self) -> int:
        return int(self.channels.model_version.value)

    def report_step_tokens(self, tokens: int) -> None:
        """The forwarded tokens the last optimizer step used: the allowance window follows it.

        Called after the step's weight push, so it also ends a `hold_admission`."""
        self.allowance.after_step(tokens)
        self._publish_allowance()

    def follow_token_budget(self, token_budget: int) -> None:
        """The trainer's row budget followed a restored server: until the first step reports
        its tokens, the allowance assumes full rows of the new budget."""
        self.allowance.assume_step(self._full_step(token_budget))
        self._publish_allowance()

    def _full_step(self, row_tokens: int) -> int:
        return initial_step_tokens(row_tokens, self.config.gradient_accumulation_steps,
                                   getattr(self.config, "world_size", 1))

    def hold_admission(self) -> None:
        """Start no new group until the next `report_step_tokens` (see `TokenAllowance`)."""
        self.allowance.hold()
        self._publish_allowance()

    def finish(self, timeout_s: float) -> bool:
        """Ask the worker to stop and wait up to `timeout_s` for its last observations (for
        `drain_metrics`), the groups still in flight included, not for its exit (`stop` reaps
        it). The run's last step calls it: what the worker observes later is never logged.
        False on timeout."""
        self.channels.stop.set()
        with self._kill_if_hung_while_reading():
            return self._await_flush(timeout_s)

    def _await_flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0 and not self._stopped:
            try:
                batch = self.channels.metrics.get(timeout=min(PULL_POLL_S, remaining))
            except queue.Empty:
                if not self._process.is_alive():
                    return False
                continue
            except (EOFError, OSError):
                return False
            if batch == METRICS_FLUSHED:
                return True
            self._trainer_observations += batch
        return False

    @property
    def server_down(self) -> bool:
        """The worker lost the vLLM server and waits for the trainer to restore it."""
        return self.channels.server_down.is_set()

    def server_restored(self) -> None:
        """The server is back with the trainer's weights: the worker re-reads its facts (it
        may have come back with other flags) and dispatches again. Counted before the flag
        clears, so a worker that sees it clear also sees the count."""
        with self.channels.server_restores.get_lock():
            self.channels.server_restores.value += 1
        self.channels.server_down.clear()

    @property
    def queue_size(self) -> int:
        try:
            return self.channels.samples.qsize()
        except NotImplementedError:  # macOS has no sem_getvalue
            return -1

    def pull(self, timeout: float, version: int | None = None) -> list[TrainingSample | PromptConsumed]:
        """Up to `timeout` s for at least one item; returns [] on timeout. Samples more than
        max_staleness behind `version` drop: the version that will train them (the trainer's,
        ahead of the served one while a push is in flight); None: the served one."""
        with self._kill_if_hung_while_reading():
            return self._pull(timeout, self.model_version if version is None else version)

    @contextlib.contextmanager
    def _kill_if_hung_while_reading(self) -> Iterator[None]:
        """A queue read that has begun a message blocks until all of it came: a worker frozen
        halfway through writing one (SIGSTOP, a debugger) held the pull (or a metrics read), and
        its heartbeat check, until the queue_pull stall (30 min by default). Meanwhile a watch
        thread kills a worker whose heartbeat is older than rollout_worker_timeout (+
        HUNG_READ_MARGIN_S): the read gets EOF, and the pull's health check names the hung
        worker as it would have."""
        done = threading.Event()
        process, limit = self._process, self.config.rollout_worker_timeout + HUNG_READ_MARGIN_S

        def watch() -> None:
            while not done.wait(HUNG_READ_CHECK_S):
                if time.time() - self.channels.heartbeat.value > limit:
                    self._killed_as_hung = True
                    with contextlib.suppress(OSError):
                        os.kill(process.pid, signal.SIGKILL)
                    return

        if process is not None:
            threading.Thread(target=watch, name="grpo-agent-pull-watch", daemon=True).start()
        try:
            yield
        finally:
            done.set()

    def _pull(self, timeout: float, version: int) -> list[TrainingSample | PromptConsumed]:
        deadline = time.monotonic() + timeout
        items: list = []
        while not items:
            self._check_health()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            try:
                items.append(self.channels.samples.get(timeout=min(PULL_POLL_S, remaining)))
            except queue.Empty:
                continue
            except (EOFError, OSError) as error:  # the child died mid-message
                self._process.join(5.0)  # EOF means its write end closed: let it be reaped
                self._check_health()
                raise RolloutWorkerError(f"The sample queue broke: {error!r}") from error
        while len(items) < MAX_ITEMS_PER_PULL:
            try:
                items.append(self.channels.samples.get_nowait())
            except (queue.Empty, EOFError, OSError):  # a broken queue shows at the next pull
                break
        self._trainer_observations.append(("rollout/queue_size", float(self.queue_size)))
        return self._drop_stale(items, version)

    def recheck_carry(self, samples: list[TrainingSample],
                      version: int | None = None) -> list[TrainingSample | PromptConsumed]:
        """A step's carry against the version now trained (`version`, as `pull`'s): the last
        step's push may have made some of it more than max_staleness versions old (under
        max_staleness=0, all of it)."""
        version = self.model_version if version is None else version
        kept, observations = self.allowance.recheck_carry(samples, version)
        self._trainer_observations += observations
        return kept

    def drain_metrics(self) -> list[Observation]:
        """Everything observed since the last call, for `grpo_agent.metrics.MetricWindow.extend`."""
        observations, self._trainer_observations = self._trainer_observations, []
        if self._stopped:
            return observations
        with self._kill_if_hung_while_reading():
            return observations + self._read_metrics_queue()

    def _close_our_write_ends(self) -> None:
        """Only the child writes to the queues. With our copy of each pipe's write end closed,
        a child killed mid-message leaves readers an EOF instead of a read that never returns."""
        for channel in self.channels.queues:
            channel._writer.close()  # multiprocessing.Queue has no public API for this

    def _discard_queued_samples(self) -> None:
        for _ in range(MAX_ITEMS_PER_PULL):
            try:
                self.channels.samples.get_nowait()
            except (queue.Empty, OSError, EOFError):
                return

    def _read_metrics_queue(self) -> list[Observation]:
        observations: list[Observation] = []
        while True:
            try:
                batch = self.channels.metrics.get_nowait()
                if batch != METRICS_FLUSHED:  # the reply to a flush that timed out
                    observations.extend(batch)
            except (queue.Empty, OSError, EOFError):
                return observations

    # ------------------------------------------------------------------ internals

    def _publish_allowance(self) -> None:
        self.channels.token_allowance.value = self.allowance.value()

    def _drop_stale(self, items: list, version: int) -> list:
        kept, observations = self.allowance.after_pull(items, version, time.time())
        self._trainer_observations += observations
        self._publish_allowance()
        return kept

    def _check_health(self) -> None:
        if not self._killed_as_hung:  # killed by the pull's watch: hung, not killed from outside
            self._check_alive()
        age = time.time() - self.channels.heartbeat.value
        if age > self.config.rollout_worker_timeout:
            self.stop(grace_s=0.0)  # a hung worker will not stop politely
            raise RolloutWorkerHung(
                f"The rollout worker sent no heartbeat for {age:.0f} s (rollout_worker_timeout="
                f"{self.config.rollout_worker_timeout} s): it is hung. Check the vLLM server and "
                f"{self._hang_suspects()}, or raise rollout_worker_timeout.")

    def _hang_suspects(self) -> str:
        """What most likely blocks the loop: its class's `hang_suspects` where it names them
        (the harness loop: its agent), seen through the trainer's `functools.partial`."""
        loop_cls = getattr(self._loop_cls, "func", self._loop_cls)
        return getattr(loop_cls, "hang_suspects", "any blocking reward/tool/environment code")

    def _check_alive(self) -> None:
        if self._process is None:
            raise RolloutWorkerError("The rollout worker was never started: call start() first.")
        if self.channels.failed.is_set():
            child_traceback = self._child_traceback()
            self.stop()
            raise RolloutWorkerError(f"The rollout worker failed: {child_traceback}")
        if not self._process.is_alive() and not self._stopped:
            code = self._process.exitcode
            self.stop()
            reason = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                      else f"exited with code {code}")
            raise RolloutWorkerError(
                f"The rollout worker {reason} without reporting an error: it failed while "
                "starting (importing your main script or the objects passed to it; its traceback "
                "is on stderr above), ran out of memory, or was killed from outside.")

    def _child_traceback(self) -> str:
        try:
            return self.channels.error.get(timeout=5.0)
        except (queue.Empty, OSError, ValueError):
            return "(the worker's traceback was lost)"


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
