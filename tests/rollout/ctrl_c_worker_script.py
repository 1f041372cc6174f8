"""A trainer stand-in that takes Ctrl-C as `grpo-agent train` does, for test_worker_ctrl_c.py.

It starts a real `RolloutWorker` around `Idle` (a loop that only beats its heart), announces
"starting" and "running", and on KeyboardInterrupt stops the worker at once, says
"interrupted" and exits 130. In the worker (`__mp_main__`) this module's import sleeps
IMPORT_S, as importing torch and the dataset does on a busy machine: the test's SIGINT lands
then. Usage: python ctrl_c_worker_script.py OUTPUT_DIR"""
from __future__ import annotations

import signal
import sys
import time

IMPORT_S = 3.0
if __name__ == "__mp_main__":
    time.sleep(IMPORT_S)


class Idle:
    def __init__(self, channels, **_):
        self.channels = channels

    def run(self) -> None:
        while not self.channels.stop.is_set():
            self.channels.heartbeat.value = time.time()
            time.sleep(0.05)


if __name__ == "__main__":
    from grpo_agent import AsyncGRPOConfig
    from grpo_agent.rollout.worker import RolloutWorker

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's run, whatever the runner
    config = AsyncGRPOConfig(output_dir=sys.argv[1], report_to="none", use_cpu=True,
                             max_completion_length=8, num_generations=2)
    worker = RolloutWorker(Idle, config=config, model_name="none", dataset=None, reward_funcs=[],
                           processing_class=None)
    try:
        print("starting", flush=True)
        worker.start()
        print("running", worker.pid, flush=True)
        while True:
            worker.pull(timeout=1.0)
    except KeyboardInterrupt:
        worker.stop(grace_s=0.0)
        print("interrupted", flush=True)
        sys.exit(130)
