"""Log-probs of given tokens under a transformers model: the trainer's view of the weights."""
import torch


def token_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, token].item() for i, token in enumerate(output_ids)]


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))
