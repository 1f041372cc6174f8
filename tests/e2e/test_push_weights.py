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

