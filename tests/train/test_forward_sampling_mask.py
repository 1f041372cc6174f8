"""A packed row whose samples carry the sampler's candidate sets (top-k/top-p sampling masks):
`forward_row` renormalises each trained token's log-prob over its own set, as the sampler drew
it, through tree packing, at any temperature."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import enable_tree_attention

from .conftest import VOCAB, make_sample


def _masked_samples():
    """Two rollouts of one prompt (packed sharing it) whose trained tokens each carry a
    candidate set of 4 to 20 ids holding the token; context positions carry none."""
    gen = random.Random(3)
    prompt = [gen.randrange(1, VOCAB) for _ in range(7)]
    samples = []
    for i, length in enumerate((4, 6)):
        completion = [gen.randrange(1, VOCAB) for _ in range(length)]
        trained = [0] * len(prompt) + [1] * length
        sample = make_sample(prompt + completion, trained, advantage=0.5 - i, seed=i)
        masks = []
        for token, is_trained in zip(sample.sequence.token_ids, trained):
            if not is_trained:
                masks.append(None)
                continue
            others = gen.sample([t for t in range(VOCAB) if t != token], gen.randrange(3, 20))
            masks.append([*others[: len(others) // 2], token, *others[len(others) // 2:]])
        sample.sequence.sampling_mask = masks
        samples.append(sample)
    return samples


def _reference(model, samples, temperature):
    """Per trained token, from each sample's full logits: the temperature-scaled log-softmax
    restricted to the token's candidate set; and the unrestricted one."""
    masked, full = [], []
    for sample in samples:
        seq = sample.sequence
        with torch.no_grad():
            logits = model(torch.tensor([seq.token_ids])).logits[0].double() / temperature
        for t in range(1, len(seq.token_ids)):
            if not seq.trained_mask[t]:
                continue
            allowed = torch.zeros(VOCAB, dtype=torch.bool)
            allowed[seq.sampling_mask[t]] = True
            target = seq.token_ids[t]
            masked.append(torch.log_softmax(logits[t - 1].masked_fill(~allowed, -torch.inf), -1)[target])
            full.append(torch.log_softmax(logits[t - 1], -1)[target])
    return torch.stack(masked).float(), torch.stack(full).float()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_row_renormalises_over_each_tokens_sampling_mask(tiny_qwen3, temperature):
    """The sampler drew each token from its top-k/top-p candidates only: the trainer's log-prob
    must be log_softmax over that set (at the sampling temperature), or the importance ratio
    against the sampler's log-prob is off by the mass outside the set."""
    samples = _masked_samples()
    row = pack_row(samples)
    assert row.num_tokens < row.unpacked_tokens  # the prompt is shared
    assert row.sampling_mask is not None and row.sampling_mask.shape[0] == row.num_trained
    packed = copy.deepcopy(tiny_qwen3)
    enable_tree_attention(packed)
    got = forward_row(packed, row, temperature=temperature).token.logprobs.detach()

    masked, full = _reference(tiny_qwen3, samples, temperature)
    assert (masked - full).min() > 1e-3  # the sets leave out real probability mass
    torch.testing.assert_close(got, masked, atol=1e-5, rtol=0)
