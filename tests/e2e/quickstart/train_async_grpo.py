# train_async_grpo.py: the spec's quick-start script. Changed: the import lines (grpo_agent
# instead of trl), the model (the local tiny model; the test fills in its path) and the dataset
# (a local JSON file with DeepMath-103K's columns, since tests never download).
from datasets import load_dataset
from grpo_agent import AsyncGRPOTrainer
from grpo_agent.rewards import accuracy_reward

if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    dataset = load_dataset("json", data_files="deepmath.jsonl", split="train")

    trainer = AsyncGRPOTrainer(
        model="TINY_MODEL_PATH",
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
    )
    trainer.train()
