# train_async_grpo.py: the spec's quick-start script. Changed: the import lines (grpo_agent
# instead of trl), the model (the local tiny model) and the dataset (a local one with the
# DeepMath-103K columns: conversational `prompt`, `solution`). Run length and server come from
# the environment so a test can keep it short; the training code itself is unchanged.
import os

from datasets import load_dataset
from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_agent.rewards import accuracy_reward

if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    dataset = load_dataset("json", data_files=os.environ["QUICKSTART_DATA"], split="train")

    trainer = AsyncGRPOTrainer(
        model=os.environ["QUICKSTART_MODEL"],
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
        args=AsyncGRPOConfig(
            output_dir=os.environ["QUICKSTART_OUT"],
            vllm_server_base_url=os.environ["QUICKSTART_VLLM_URL"],
            max_steps=int(os.environ.get("QUICKSTART_STEPS", "3")),
            num_generations=4,
            max_completion_length=24,
            report_to="none",
        ),
    )
    trainer.train()
