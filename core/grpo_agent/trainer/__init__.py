"""TRL's module paths (`trl.trainer.*`) as aliases, so the spec's import lines work with
`trl` -> `grpo_agent`. The classes live in `grpo_agent.rollout`, `grpo_agent.types`,
`grpo_agent.train` and `grpo_agent.config`; these modules only re-export them."""
