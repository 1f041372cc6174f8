"""Fixtures for trainer-core tests: a tiny random Qwen3 with grouped-query attention and a
factory of `TrainingSample`s (groups sharing a prompt, multi-turn samples sharing history)."""

from __future__ import annotations

import random

import pytest
import torch
from grpo_agent.types import TrainingSample, TrainingSequence

VOCAB = 96


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def tiny_qwen3():
    """A float32 random Qwen3: 4 query heads over 2 key/value heads, untied LM head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1234)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    model.eval()  # no dropout; gradients still flow
    return model


def make_sample(tokens, trained, *, advantage=1.0, group_id=0, topk=0, seed=0) -> TrainingSample:
    """A sample whose sampler log-probs (and optional top-k dicts) are deterministic noise."""
    gen = random.Random(seed)
    lps = [(-gen.uniform(0.5, 4.0) if m else 0.0) for m in trained]
    top = None
    if topk:
        top = [
            ({gen.randrange(VOCAB): -gen.uniform(0.5, 5.0) for _ in range(topk)} if m else None)
            for m in trained
        ]
    seq = TrainingSequence(
        token_ids=list(tokens),
        trained_mask=list(trained),
        sampler_logprobs=lps,
        sampler_top_logprobs=top,
    )
    return TrainingSample(
        sequence=seq, advantage=advantage, model_version=0, group_id=group_id, row_index=group_id
    )


def _rand_tokens(gen, n):
    return [gen.randrange(1, VOCAB) for _ in range(n)]


@pytest.fixture
def shared_samples():
    """Two groups of 3 rollouts sharing their prompt, plus a multi-turn fork sharing history."""
    gen = random.Random(7)
    samples = []
    for group in range(2):
        prompt = _rand_tokens(gen, 9)
        for i in range(3):
            comp = _rand_tokens(gen, 4 + i)
            samples.append(
                make_sample(
                    prompt + comp,
                    [0] * len(prompt) + [1] * len(comp),
                    advantage=(i - 1) * 0.7 + 0.1,
                    group_id=group,
                    topk=3,
                    seed=10 * group + i,
                )
            )
    history = _rand_tokens(gen, 6)
    turn1 = _rand_tokens(gen, 5)
    tool = _rand_tokens(gen, 3)
    turn2 = _rand_tokens(gen, 4)
    first = history + turn1 + tool + turn2
    samples.append(
        make_sample(
            first, [0] * 6 + [1] * 5 + [0] * 3 + [1] * 4, advantage=0.5, group_id=5, topk=3, seed=50
        )
    )
    # the fork re-reads turn1 as context and trains its own continuation
    fork = history + turn1 + _rand_tokens(gen, 2) + _rand_tokens(gen, 3)
    samples.append(
        make_sample(fork, [0] * 11 + [0] * 2 + [1] * 3, advantage=0.5, group_id=5, topk=3, seed=51)
    )
    return samples


@pytest.fixture
def sample_factory():
    return make_sample


def assert_tree_path_matches_sdpa(model, row, backend: str) -> None:
    """`model` (tree attention on) through `backend` against a copy through the dense SDPA tree
    mask: log-probs, then the gradients of a random weighting of them."""
    import copy

    from grpo_agent.train.forward import forward_row

    other = copy.deepcopy(model)
    got = forward_row(model, row, temperature=1.0, backend=backend).token.logprobs
    ref = forward_row(other, row, temperature=1.0, backend="sdpa").token.logprobs
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    weights = torch.randn_like(ref)
    (got * weights).sum().backward(), (ref * weights).sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def compiled_layer_ops(model, row, backend: str) -> list[str]:
    """Train `row` through `model` (tree attention on) and through a copy with compiled decoder
    layers: the gradients must agree. Returns the ops dynamo's graphs of the layers hold."""
    import copy

    from grpo_agent.train.forward import forward_row
    from grpo_agent.train.regional_compile import compile_decoder_layers

    ops = []

    def recording(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = copy.deepcopy(model)
    compile_decoder_layers(compiled, backend=recording)
    for each in (model, compiled):
        lp = forward_row(each, row, temperature=1.0, backend=backend).token.logprobs
        (lp * row.advantages).sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    return ops
