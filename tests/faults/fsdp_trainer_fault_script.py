"""One rank of a 2-process FSDP2 `AsyncGRPOTrainer` run (gloo, CPU) hit by a fault mid-run.

argv: model path, server port, output dir, fault. Rank 0 starts the vLLM server itself (a
`ManagedVLLMServer`, so the run's recovery may restart it) before the ranks meet.
- "kill-server": the rollout loop SIGKILLs the server as it scores the first group sampled
  after the first push (`fault_helpers.KillsTheServerAfterTheFirstPush`, which also records in
  <output dir>/groups.jsonl the weight versions the server reports for each group's tokens);
  the run must restart it, push a trained version again and reach max_steps.
- "stop-rank1": rank 1 SIGSTOPs itself as step 2 begins, after writing the time to
  <output dir>/stopped-at; rank 0 must name it in its collective stall report and exit 3.
Rank 0 writes <output dir>/steps.json: per step, the model versions of its samples and the
server restarts so far, and restored-at: when each server restore returned (time.time(), one a
line); each rank writes done-rank<RANK> with its final global step.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the spawned worker imports fault_helpers too
from datasets import Dataset
from fault_helpers import KillsTheServerAfterTheFirstPush, timing_restores, token_sum_reward
from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_agent.sampler.recovery import ServerRecovery
from grpo_agent.sampler.server import ManagedVLLMServer
from transformers import TrainerCallback

MAX_STEPS = 4
COLLECTIVE_DEADLINE_S = 10
# The run's timeouts, which the test derives the phase deadlines from (grpo_agent.stall).
TIMEOUTS = {"vllm_server_timeout": 120, "rollout_worker_timeout": 300,
            "stall_timeouts": {"collective": COLLECTIVE_DEADLINE_S}}


class Recorder(TrainerCallback):
    """Rank 0: each step's sample versions and the restarts so far. Rank 1 ("stop-rank1"):
    freezes itself as step 2 begins."""

    def __init__(self, trainer, out: Path, fault: str) -> None:
        self.trainer, self.out, self.fault, self.steps = trainer, out, fault, []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.fault == "stop-rank1" and os.environ["RANK"] == "1" and state.global_step == 1:
            (self.out / "stopped-at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_step_end(self, args, state, control, **kwargs):
        if os.environ["RANK"] != "0":
            return
        self.steps.append({"step": state.global_step,
                           "versions": [s.model_version for s in self.trainer._step_samples],
                           "restarts": self.trainer.recovery.restarts,
                           "model_version": self.trainer.model_version})
        (self.out / "steps.json").write_text(json.dumps(self.steps))


if __name__ == "__main__":
    model, port, out, fault = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    rank = os.environ["RANK"]
    url = f"http://127.0.0.1:{port}"
    server = None
    if rank == "0":
        server = ManagedVLLMServer(model, port=port, dtype="float32", weight_transfer_backend="gloo",
                                   max_model_len=512, enforce_eager=True,
                                   log_path=out / "server.log").start()
        (out / "server-pids").open("a").write(f"{server.pid}\n")
        os.environ["GRPO_FAULT_SERVER_PID"] = str(server.pid)
        os.environ["GRPO_FAULT_GROUPS"] = str(out / "groups.jsonl")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"go {i}"}]} for i in range(200)])
    args = AsyncGRPOConfig(
        output_dir=str(out), vllm_server_base_url=url, num_generations=2, max_completion_length=8,
        token_budget=128, max_steps=MAX_STEPS, num_train_epochs=1000, save_strategy="no",
        report_to="none", use_cpu=True, logging_steps=1, disable_tqdm=True,
        gradient_checkpointing=False, optim="adamw_torch", **TIMEOUTS,
        # On-policy for "kill-server": a step after the restore trains only samples of the
        # current version, none of the old server's backlog (with the default 4 the queue held
        # enough version-0 samples for every step up to max_steps).
        max_staleness=0 if fault == "kill-server" else 4)
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=token_sum_reward, train_dataset=dataset, args=args)
    if fault == "kill-server":
        trainer.loop_cls = KillsTheServerAfterTheFirstPush
    trainer.add_callback(Recorder(trainer, out, fault))
    restored = []
    ServerRecovery.restore = timing_restores(restored)
    try:
        trainer.train()
    finally:
        (out / f"restored-at-rank{rank}").write_text("".join(f"{t}\n" for t in restored))
        if server is not None:
            (out / "server-pids").open("a").write(f"{server.pid}\n")
            server.stop()
    (out / f"done-rank{rank}").write_text(str(trainer.state.global_step))
    if rank == "0":
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
