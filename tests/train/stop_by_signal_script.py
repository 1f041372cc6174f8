"""A run stopped by a signal while it waits for samples, for tests/train/test_stopped_run_metrics.py.

An offline trainer (tiny model, CPU, `logging_steps=2`) under `grpo-agent train`'s own SIGTERM
handler. Its stand-in rollout worker hands one group per pull and counts a tool failure for
each, then runs dry: it writes how many groups it handed to `<output_dir>/waiting` and waits.
It takes Ctrl-C as a run started in a terminal does, even where it inherits SIGINT ignored.
Usage: python stop_by_signal_script.py OUTPUT_DIR"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from grpo_agent import AsyncGRPOConfig
from grpo_agent.testing import build_tiny_model
from grpo_agent.testing.offline import OfflineTrainer, ScriptedWorker
from grpo_agent.train.reporting import JsonlMetricsCallback
from grpo_agent.train.run import _exit_on_sigterm
from test_step_read import TOKEN_BUDGET, group

GROUPS = 4  # one per step (a row holds one), and the one that closes step 3


class RunsDry(ScriptedWorker):
    def __init__(self, output_dir: str) -> None:
        super().__init__([])
        self.groups = [group(g) for g in range(GROUPS)]
        self.handed = 0
        self.observations = []
        self.waiting = Path(output_dir) / "waiting"

    def pull(self, timeout, version=None):
        if self.handed < len(self.groups):
            self.handed += 1
            self.observations.append(("tools/search/failure_count", 1.0))
            return self.groups[self.handed - 1]
        self.waiting.write_text(str(self.handed))
        time.sleep(timeout)  # as the real worker's pull waits for its queue
        return []

    def drain_metrics(self):
        observations, self.observations = self.observations, []
        return observations


class DryTrainer(OfflineTrainer):
    def start_pipeline(self):
        super().start_pipeline()
        self.source = self._step_source(RunsDry(self.args.output_dir))


if __name__ == "__main__":
    # A test runner started as a background job (`make test &` in a script) ignores SIGINT and
    # its children inherit that; Python then installs no KeyboardInterrupt handler, and the
    # SIGINT the test sends would be dropped (the run waited for samples until killed).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = AsyncGRPOConfig(
        output_dir=sys.argv[1], max_steps=10, logging_steps=2, token_budget=TOKEN_BUDGET,
        gradient_checkpointing=False, optim="adamw_torch", report_to="none",
        disable_tqdm=True, use_cpu=True, save_strategy="no")
    trainer = DryTrainer(build_tiny_model(), args=args, reward_funcs=[],
                         train_dataset=[{"prompt": []}] * 64)
    trainer.samples = []
    trainer.add_callback(JsonlMetricsCallback())
    with _exit_on_sigterm():
        trainer.train()
