"""Spec lines 630-658: the curriculum rollout loop and its trainer (verbatim, `trl` ->
`grpo_agent`), plus the test's reward: every rollout of an "easy" prompt passes, a "hard"
prompt's rollouts pass rarely (when their token ids sum to a multiple of 8)."""
from dataclasses import dataclass

import numpy as np
from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_agent.trainer.async_grpo_trainer import AsyncRolloutLoop


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop


def easy_or_rare_reward(prompts, completion_ids, **kwargs):
    easy = ["easy" in prompt[-1]["content"] for prompt in prompts]
    return [1.0 if is_easy else float(sum(ids) % 8 == 0) for is_easy, ids in zip(easy, completion_ids)]
