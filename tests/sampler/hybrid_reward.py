"""A reward with spread for the tiny random hybrid (importable by the spawned rollout worker):
accuracy is 0 for every rollout of a random model, so its groups would all be dropped."""


def token_parity_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 2) for ids in completion_ids]
