"""The trainer's rollout pipeline: server check, weight pusher, rollout worker, step source,
each step's plan (rank 0 pulls and plans, the other ranks receive it), server recovery.

Design decision: `AsyncGRPOTrainer` starts the pipeline at train begin (after a resumed
checkpoint is loaded, so the worker's position and the pushed weights match the restored
model) and always stops it when `train()` returns or raises. Only rank 0 runs a worker; it is
the one process that reads the sample queue, and its stall watch reports on both sides.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from grpo_agent import stall
from grpo_agent.metrics import Observation
from grpo_agent.rollout.allowance import holds_before_push
from grpo_agent.rollout.worker import RolloutWorker
from grpo_agent.sampler.recovery import ServerRecovery
from grpo_agent.train import collectives, flash_impl, fsdp, heap, setup
from grpo_agent.train.batching import StepPlan, StepPlanner, trained_only
from grpo_agent.train.step_source import StepSource
from grpo_agent.types import TrainingSample

logger = logging.getLogger(__name__)

# What rank 0 sends instead of a step plan when the worker lost the server (FSDP).
RESTORE_REQUEST = "restore the vLLM server"


class RolloutPipelineMixin:
    """Starts, wires and stops the pipeline of an `AsyncGRPOTrainer` (its `source`, `pusher`,
    `stalls` and `token_budget`), and pulls each step's plan from it."""

    def start_pipeline(self) -> None:
        """Check the server, push restored weights if resuming, start the rollout worker."""
        # Stage deadlines and stall_report.json (grpo_agent/stall.py); under FSDP every rank
        # watches its collective phases (train/collectives.py).
        self.stalls = collectives.rank_watch(self.args, context=self._stall_context)
        facts = setup.check_server(self.args, self.model)
        self._use_token_budget(setup.token_budget(self.args.token_budget, facts.max_model_len))
        self.served_step = self.state.global_step  # the (restored) model's weights, served now
        self.pusher = self.pusher_factory(self.args, self.model, facts)  # LoRA adapters or merged
        # Kept after train(): evaluate() then loads the adapter again (train/evaluation.py).
        self.synced_lora_name = self.pusher.lora_name
        self.recheck_served = self.pusher.lora_name is None
        # Push before the first rollout only when the served weights can differ from ours: a
        # resumed run, a server an earlier run pushed into, a model not known to be the
        # checkpoint a fresh server loaded (`weights.served_weights_may_differ`).
        if self.state.global_step > 0 or self.pusher.needs_initial_push(
                self.model, facts.holds_pushed_weights):
            self.model_version += 1
            self.push_weights()
            self.settle_push()  # the worker's first groups are labelled with this version
        if fsdp.is_main_process():
            self.source = self._step_source(self._start_worker(facts.model_id))
            self.pusher.on_served = self.source.worker.set_model_version
            self.stalls.peer_pid = self.source.worker.pid
            stall.on_abort(self._kill_worker)

    def _start_worker(self, model_name: str) -> RolloutWorker:
        """Spawn the rollout worker at the ledger's frontier, on our model version."""
        worker = RolloutWorker(
            self.loop_cls, config=self.args, model_name=model_name, dataset=self.train_dataset,
            reward_funcs=self.reward_funcs, processing_class=self.processing_class,
            tools=self.tools, environment_factory=self.environment_factory,
            dataset_start_index=self.ledger.frontier, token_budget=self.token_budget,
            lora_name=self.pusher.lora_name)  # the adapter name prefix under LoRA sync
        worker.set_model_version(self.model_version)
        worker.start()
        return worker

    def _step_source(self, worker: Any) -> StepSource:
        """Steps from `worker` (a `RolloutWorker`, or a stand-in with its trainer-side methods)."""
        return StepSource(worker, ledger=self.ledger, epochs_done=self.prompt_epochs_done,
                          prompt_limit=self.prompt_limit(),
                          window=self.window, no_progress_timeout=self.args.no_progress_timeout,
                          temperature=self.args.temperature,
                          restore_server=self._restore_server,
                          trained_version=lambda: self.model_version)

    def _next_step_plan(self) -> tuple[StepPlan, list[TrainingSample]]:
        """Rank 0 pulls the step's samples from the worker and plans them into packed rows;
        under FSDP the other ranks receive the same plan (and the ledger, so every rank makes
        the same stop decision). The time spent waiting for samples is one of the plan's
        metrics, logged with the step that trains them."""
        self.phases.enter("step plan", step=(step := self.state.global_step + 1))  # rank 0 pulls
        plan, samples = None, []
        if self.source is not None:
            planner = StepPlanner(
                token_budget=self.token_budget,
                num_processes=fsdp.world_size(),
                grad_accum_steps=self.args.gradient_accumulation_steps,
            )
            self._planning = planner  # a restore during the pull may grow its budget
            try:
                with heap.cyclic_gc_paused():  # a trie node per token: no cycles, many objects
                    samples, waited = self.source.next_step(planner)
                    plan = planner.plan()
            finally:
                self._planning = None
            plan.metrics["perf/rollout_wait_s"] = waited
            if holds_before_push(self.args.max_staleness) and self._step_ends_with_push():
                self.source.worker.hold_admission()  # until the push: new groups would arrive stale
        if fsdp.world_size() > 1:
            plan, samples, self.ledger = self._share_step_plan((plan, samples, self.ledger))
        self.phases.enter("train step", step=step)  # FSDP gathers and reductions
        return plan, samples

    def plan_ahead(self, control: Any) -> None:
        """Pull and plan the next step now, at the end of this one, while the GPU still runs
        this step's queued rows: the host then waits for them with the next plan in hand,
        instead of planning after the wait with the GPU idle (58 of a 1.7B step's 428 ms on
        an H100, docs/performance.md). Not when this step ends the run, saves or evaluates:
        a checkpoint or an evaluation never happens with pulled samples untrained."""
        if not (control.should_training_stop or control.should_save or control.should_evaluate):
            self._planned_ahead = self._next_step_plan()

    def take_step_plan(self) -> StepPlan:
        """This step's plan (planned ahead at the last step's end, else now); its samples
        become the step's: all of them consumed (`_step_samples`, which the ledger records),
        those but the plan's oversize drops trained (`_step_trained`, `step_trained_tokens`;
        counted with the drops, a step's trained tokens per second overstated it)."""
        plan, samples = self._planned_ahead or self._next_step_plan()
        self._planned_ahead = None
        self._step_samples = samples
        self._step_trained = trained_only(samples, plan.dropped)
        self.step_trained_tokens = sum(s.sequence.num_trained for s in self._step_trained)
        return plan

    def _step_ends_with_push(self) -> bool:
        return (self.state.global_step + 1) % self.args.weight_sync_steps == 0

    @functools.cached_property
    def recovery(self) -> ServerRecovery:
        """Brings a dead server back: rank 0 restores it and checks it as `setup.check_server`
        did at start (`setup.server_needs`), every rank pushes again."""
        needs = setup.server_needs(self.args, self.model,
                                   lora_sync=getattr(self.pusher, "lora_name", None) is not None)
        return ServerRecovery(self.args.vllm_server_base_url, self.args.vllm_server_timeout,
                              ranks=self.phases, needs=needs)

    def server_restores(self) -> int:
        """How many times this run restored its server: an evaluation reads the server's facts
        again after one (`rollout.evaluation.EvalSession`). Its thread calls this, so it never
        builds `recovery` (that is the trainer's own thread's)."""
        recovery = self.__dict__.get("recovery")
        return 0 if recovery is None else recovery.restarts

    def push_weights(self) -> None:
        """Push the policy as `model_version`; a failed push is retried once after restoring
        the server (`sampler.recovery`). The push may still be sending when this returns
        (`weight_sync.full`); the worker samples the version once it landed."""
        self._pushing(self.recovery.push)

    def settle_push(self) -> None:
        """Until the server serves `model_version` (before an evaluation, at the last step)."""
        self._pushing(self.recovery.settle)

    def _pushing(self, action: Any) -> None:
        restarts = self.recovery.restarts
        with self.phases.during("weight push", version=self.model_version):  # gathers on all ranks
            self.window.update(action(self.pusher, self.model, self.model_version))
        if self.recovery.restarts != restarts:
            self._server_restored()

    def _restore_server(self) -> None:
        """The worker lost the server: bring it back with our weights, then let it go on.
        Rank 0 calls this from its queue pull; under FSDP it first tells the other ranks,
        which wait for its step plan (`_share_step_plan`), so they push with it."""
        if fsdp.is_main_process() and fsdp.world_size() > 1:
            torch.distributed.broadcast_object_list([RESTORE_REQUEST], src=0)
        with self.phases.during("weight push", version=self.model_version):  # gathers on all ranks
            self.window.update(self.recovery.restore(self.pusher, self.model, self.model_version,
                                                     cause="the rollout worker lost it"))
        self._server_restored()

    def _server_restored(self) -> None:
        """After a restore: the token budget follows the restored server's max_model_len where
        it was taken from the server (`setup.token_budget`, `_use_token_budget`; rank 0 plans,
        and has the facts), and the worker re-reads the server's facts before its next group.
        The restore pushed the weights of now under the current version (`served_step`)."""
        self.served_step = self.state.global_step
        facts = self.recovery.facts
        if facts is not None:
            budget = setup.token_budget(self.args.token_budget, facts.max_model_len,
                                        self.token_budget)
            if budget != self.token_budget:
                logger.warning(
                    "token_budget follows the restored vLLM server's max_model_len: %d -> %d "
                    "(packed rows of up to %d tokens from now on; set token_budget to keep it "
                    "fixed).", self.token_budget, budget, budget)
                self._use_token_budget(budget)
        if self.source is not None:
            self.source.worker.server_restored()

    def _use_token_budget(self, budget: int) -> None:
        """The one home of the row budget (at start, and when it follows a restored server):
        the trainer's, the step being planned's, FlashAttention's kernel choice and the worker's
        allowance before its first step (each kept the start budget after a restore)."""
        self.token_budget = budget
        # FlashAttention 4 only for GPU-bound rows (long, or replayed through CUDA graphs)
        flash_impl.expect_rows(budget, replayed=self.args.cuda_graphs)
        if self._planning is not None:  # restored during this step's pull
            self._planning.token_budget = budget  # grows only: its rows still fit
        if self.source is not None:
            self.source.worker.follow_token_budget(budget)

    def _share_step_plan(self, plan: Any) -> Any:
        """Under FSDP: rank 0's step `plan` on every rank. Before it, rank 0 may send restore
        requests (`_restore_server`): the other ranks then take part in the restore's push
        and wait on."""
        box = [plan]
        torch.distributed.broadcast_object_list(box, src=0)
        while isinstance(box[0], str) and box[0] == RESTORE_REQUEST:
            self._restore_server()
            box = [None]
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def _stall_context(self) -> dict[str, Any]:
        """What the trainer's stall report records besides its stages and stacks."""
        worker = self.source.worker if self.source is not None else None
        return {"global_step": self.state.global_step, "model_version": self.model_version,
                "server": self.args.vllm_server_base_url,
                "sample_queue_size": worker.queue_size if worker else None,
                "worker_pid": worker.pid if worker else None, "prompt_frontier": self.ledger.frontier}

    def _kill_worker(self) -> None:
        if self.source is not None:
            self.source.worker.stop(grace_s=0.0)

    def _stop_pipeline(self, *, at_once: bool = False) -> list[Observation]:
        """Stop the worker (`at_once`: without waiting for it to flush, the run was
        interrupted and nothing it still sends would be trained), then the pusher. A step
        planned ahead goes with the worker (a later `train()` pulls from its own). Returns the
        metrics the worker sent since the last step took them (a failed run logs them)."""
        left: list[Observation] = []
        self._planned_ahead = None
        self.phases.leave()
        stall.remove_abort(self._kill_worker)
        if getattr(self, "stalls", None) is not None:
            self.stalls.stop()
            self.stalls = None
        if self.source is not None:
            self.source.worker.stop(**({"grace_s": 0.0} if at_once else {}))
            left = self.source.worker.drain_metrics()
            self.source = None
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        return left
