"""`grpo-agent train --env words` whose final save hangs, for tests/train/test_final_save.py.

The CLI and `run_training` are real; the trainer is the offline one (scripted samples, no
server, `--vllm-url` never contacted): it trains one step, writes checkpoint-1, then its final
save writes the model, writes `<output_dir>/saving` and sleeps until the test's Ctrl-C. It
takes Ctrl-C as a run started in a terminal does, even where it inherits SIGINT ignored.
Usage: python final_save_script.py OUTPUT_DIR"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from grpo_agent.cli.main import main
from grpo_agent.testing.offline import OfflineTrainer
from grpo_agent.train import trainer
from test_step_read import TOKEN_BUDGET, group


class HangsInTheFinalSave(OfflineTrainer):
    def start_pipeline(self):
        self.samples = [s for g in range(2) for s in group(g)]  # step 1, and one that closes it
        super().start_pipeline()

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        if not Path(output_dir).name.startswith("checkpoint-"):  # the final save
            (Path(self.args.output_dir) / "saving").write_text("")
            while True:
                time.sleep(1)


if __name__ == "__main__":
    # A test runner started as a background job ignores SIGINT and its children inherit that;
    # Python then installs no KeyboardInterrupt handler, and the CLI none of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    trainer.AsyncGRPOTrainer = HangsInTheFinalSave  # what run_training builds
    settings = {"max_steps": 1, "token_budget": TOKEN_BUDGET, "save_strategy": "steps",
                "save_steps": 1, "learning_rate": 3e-4, "use_cpu": "true", "report_to": "none",
                "gradient_checkpointing": "false", "optim": "adamw_torch"}
    main(["train", "--env", "words", "--vllm-url", "http://127.0.0.1:9", "--output-dir",
          sys.argv[1], *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]])
