"""Spec lines 457-459, example 1 (verbatim): reward longer completions."""


def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]
