"""AsyncGRPOTrainer under torchrun (2 processes, gloo, CPU) against a running vLLM server.

argv: model path, server URL, output dir, max_steps, and "resume" to resume from the last
checkpoint. Each rank writes its final global step to <output dir>/done-rank<RANK>.
"""
import os
import sys
from pathlib import Path

import torch.distributed
from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_agent.demo import letter_fraction, load_prompts

if __name__ == "__main__":
    model, url, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    resume = len(sys.argv) > 5
    args = AsyncGRPOConfig(
        output_dir=out, vllm_server_base_url=url, max_steps=steps, num_generations=4,
        max_completion_length=16, learning_rate=1e-4, report_to="none", save_steps=2,
        gradient_checkpointing=False, optim="adamw_torch", disable_tqdm=True, token_budget=512,
    )
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=letter_fraction,
                               train_dataset=load_prompts(), args=args)
    trainer.train(resume_from_checkpoint=True if resume else None)
    rank = os.environ.get("RANK", "0")
    Path(out, f"done-rank{rank}").write_text(str(trainer.state.global_step))
    # Leave the process group before the interpreter exits, as PyTorch asks of scripts: gloo's
    # threads torn down at exit aborted a finished rank now and then ("terminate called without
    # an active exception", SIGABRT).
    torch.distributed.destroy_process_group()
