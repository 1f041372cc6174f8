"""Vision-language checkpoints: the vision tower and the multimodal projector are frozen and
never pushed; a Qwen3.5 image-text-to-text checkpoint (its layer types on the text config)
loads into tree packing with its Gated DeltaNet layers on the tree path."""

from __future__ import annotations

import copy

import torch
from grpo_agent.config import AsyncGRPOConfig
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.setup import load_model
from grpo_agent.train.tree_attention import enable_tree_attention
from grpo_agent.train.weights import full_weights

from .conftest import VOCAB, make_sample

TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "max_position_embeddings": 256}


def _args(tmp_path) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, dtype="float32")


def _frozen_and_pushed(model):
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    pushed = {n for n, _ in full_weights(model)}
    return frozen, pushed


def test_qwen3_5_checkpoint_freezes_tower_and_merger_and_packs(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen3_5Config(
        text_config=TEXT, image_token_id=90, video_token_id=91, vision_start_token_id=92,
        vision_end_token_id=93,
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 4, "num_position_embeddings": 16},
    )
    Qwen3_5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "vlm")
    model = load_model(str(tmp_path / "vlm"), _args(tmp_path)).float().eval()
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    frozen, pushed = _frozen_and_pushed(model)
    assert any(".visual.merger." in n for n in frozen)  # Qwen-VL's projector
    assert frozen == {n for n, _ in model.named_parameters() if ".visual." in n}
    assert not any(".visual." in n for n in pushed)
    assert "model.language_model.layers.0.linear_attn.A_log" in pushed

    plain = copy.deepcopy(model)
    enable_tree_attention(model)  # layer types come from the text config
    assert model._grpo_linear_layers == 3
    samples = [make_sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1]),
               make_sample([1, 2, 3, 7], [0, 0, 1, 1]), make_sample([1, 2, 8], [0, 0, 1])]
    got = forward_row(model, pack_row(samples), temperature=1.0).token.logprobs
    ref = []
    for s in samples:
        logits = plain(input_ids=torch.tensor([s.sequence.token_ids])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        ref += [logp[t - 1, s.sequence.token_ids[t]] for t in range(2, s.num_tokens)]
    torch.testing.assert_close(got, torch.stack(ref), atol=1e-5, rtol=0)


def test_llava_style_projector_is_frozen_and_skipped(tmp_path):
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen3Config,
    )

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, image_size=16, patch_size=8)
    text = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=VOCAB - 1)
    LlavaForConditionalGeneration(cfg).save_pretrained(tmp_path / "llava")
    model = load_model(str(tmp_path / "llava"), _args(tmp_path))
    frozen, pushed = _frozen_and_pushed(model)
    projector = {n for n, _ in model.named_parameters() if "multi_modal_projector" in n}
    tower = {n for n, _ in model.named_parameters() if "vision_tower" in n}
    assert projector and tower and frozen == projector | tower
    assert not pushed & (projector | tower)
    assert any("language_model" in n for n in pushed)
