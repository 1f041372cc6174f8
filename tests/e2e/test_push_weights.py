"""What the trainer pushes: HF names, merged LoRA under base names, no vision tower."""
import pytest
import torch
from grpo_agent.testing import build_tiny_model
from grpo_agent.train.weights import full_weights, is_vision_tower_param, merged_adapters
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model()


def test_full_weights_are_the_model_parameters_under_their_hugging_face_names(tiny_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    pushed = dict(full_weights(model))
    assert pushed.keys() == dict(model.named_parameters()).keys()
    assert "model.layers.0.self_attn.q_proj.weight" in pushed


def test_lora_push_sends_merged_weights_under_base_names_and_unmerges_after(tiny_path):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    names = set(dict(base.named_parameters()))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # non-zero so merging changes the weights
    q_name = "model.layers.0.self_attn.q_proj.weight"
    before = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    with merged_adapters(model):
        pushed = {k: v.clone() for k, v in full_weights(model)}
    assert set(pushed) == names
    lora = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (lora.lora_B["default"].weight @ lora.lora_A["default"].weight) * lora.scaling["default"]
    torch.testing.assert_close(pushed[q_name], before + delta)
    torch.testing.assert_close(lora.base_layer.weight, before)  # unmerged again


def test_vision_tower_names_are_recognised():
    assert is_vision_tower_param("model.visual.blocks.0.attn.qkv.weight")
    assert not is_vision_tower_param("model.language_model.layers.0.mlp.up_proj.weight")



def alternating_reward(completions, **kwargs):
    """0, 1, 0, 1, ...: every group has reward variance, so every group trains."""
    return [float(i % 2) for i in range(len(completions))]


def _sampled_gap(model, samples) -> float:
    """The largest gap between a trained token's sampler log-prob and `model`'s."""
    gaps = []
    for sample in samples:
        seq = sample.sequence
        with torch.no_grad():
            logits = model(torch.tensor([seq.token_ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        gaps += [abs(logprobs[i - 1, seq.token_ids[i]].item() - seq.sampler_logprobs[i])
                 for i in range(1, len(seq.token_ids)) if seq.trained_mask[i]]
    return max(gaps)


@pytest.mark.vllm
def test_a_model_changed_in_memory_is_pushed_before_the_first_rollout_an_unchanged_one_is_not(
        trained_server, tmp_path, record_trained):
    """On a fresh server (the checkpoint's weights, vLLM's start label), a model loaded and
    changed in memory, then passed to the trainer, was never pushed at start: its first
    rollouts were sampled by the checkpoint's weights and labelled version 0. Now they are its
    own, as version 1. A model the trainer loads itself and nobody changed is not pushed: the
    fresh server already serves it (no cold push, DESIGN 6c)."""
    from datasets import Dataset
    from grpo_agent import AsyncGRPOConfig, AsyncGRPOTrainer

    from tests.conftest import serve_fresh

    def changed():
        model = AutoModelForCausalLM.from_pretrained(trained_server.model_path, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.5)
        return model

    def run(model, name):
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / name), vllm_server_base_url=trained_server.base_url,
            num_generations=2, max_completion_length=8, token_budget=64, max_steps=1,
            learning_rate=0.0, save_strategy="no", report_to="none", use_cpu=True)
        trainer = AsyncGRPOTrainer(
            model=model, args=args, reward_funcs=alternating_reward,
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "A cat"}]] * 4}))
        trained = record_trained(trainer)
        trainer.train()
        return [s for s in trained if s.sequence.num_trained]

    serve_fresh(trained_server)
    samples = run(changed(), "changed")
    assert samples and {s.model_version for s in samples} == {1}
    checkpoint = AutoModelForCausalLM.from_pretrained(trained_server.model_path, dtype=torch.float32)
    assert _sampled_gap(changed(), samples) < 2e-3 and _sampled_gap(checkpoint, samples) > 2e-2
    serve_fresh(trained_server)
    samples = run(str(trained_server.model_path), "unchanged")
    assert samples and {s.model_version for s in samples} == {0}
    assert _sampled_gap(checkpoint, samples) < 2e-3
