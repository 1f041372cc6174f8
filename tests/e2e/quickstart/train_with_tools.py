# The agent path end to end: the words task with a tool exposed (`tools=[number_to_words]`),
# so every prompt carries the tool schema and every turn goes through the tool-call parser.
# Run as a script because the rollout worker is spawned and re-imports it.
import sys

from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_agent.demo import letter_fraction, load_prompts, number_to_words
from grpo_agent.train.reporting import JsonlMetricsCallback

if __name__ == "__main__":
    model_path, base_url, out = sys.argv[1:4]
    trainer = AsyncGRPOTrainer(
        model=model_path,
        reward_funcs=letter_fraction,
        train_dataset=load_prompts(),
        tools=[number_to_words],
        args=AsyncGRPOConfig(
            output_dir=out, vllm_server_base_url=base_url, max_steps=3, num_generations=4,
            max_completion_length=24, max_tool_calling_iterations=2, learning_rate=0.0,
            gradient_checkpointing=False, optim="adamw_torch", save_strategy="no",
        ),
        callbacks=[JsonlMetricsCallback()],
    )
    trainer.train()
