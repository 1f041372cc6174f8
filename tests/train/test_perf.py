"""FLOPs for MFU: what a packed row really computes, checked against a count by hand."""
import pytest
import torch
from grpo_agent.train import perf
from grpo_agent.train.packing import pack_row
from grpo_agent.types import TrainingSample, TrainingSequence
from transformers import Qwen3Config

D, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 128, 96, 2


def config(**kwargs) -> Qwen3Config:
    return Qwen3Config(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, **kwargs)


def sample(completion: list[int]) -> TrainingSample:
    ids = [5, 6, 7, *completion]
    mask = [0, 0, 0, 1, 1]
    return TrainingSample(TrainingSequence(ids, mask, [0.0] * 5), advantage=1.0,
                          model_version=0, group_id=0, row_index=0)


@pytest.fixture
def row():
    """Two rollouts of one 3-token prompt. The trie shares tokens 5 and 6; token 7 is not
    shared, as each copy predicts a different trained token. Nodes and their depths:
    5:0 6:1 | 7:2 8:3 9:4 | 7:2 10:3 11:4, so 8 forwarded tokens (10 unpacked), and each
    sees depth + 1 keys: 1+2 + (3+4+5) * 2 = 27 visible pairs; 4 trained tokens."""
    row = pack_row([sample([8, 9]), sample([10, 11])])
    assert (row.num_tokens, row.unpacked_tokens, row.num_trained) == (8, 10, 4)
    return row


PROJECTIONS = 2 * (D * HEADS * HEAD_DIM * 2 + D * KV_HEADS * HEAD_DIM * 2)  # q, o; k, v
MLP = 2 * 3 * D * FFN  # gate, up, down
PER_PAIR = 2 * 2 * HEADS * HEAD_DIM  # QK^T and AV
LM_HEAD = 2 * D * VOCAB


def test_a_packed_row_counts_its_tokens_visible_pairs_and_trained_positions(row):
    by_hand = LAYERS * ((PROJECTIONS + MLP) * 8 + PER_PAIR * 27) + LM_HEAD * 4
    assert perf.forward_flops(config(), row.position_ids, row.num_trained) == by_hand
    assert perf.training_flops(config(), row.position_ids, row.num_trained) == 3 * by_hand
    assert perf.packed_training_flops(config(), [row, row]) == 6 * by_hand


def test_a_sliding_window_layer_counts_only_the_keys_in_its_window(row):
    cfg = config(layer_types=["full_attention", "sliding_attention"], sliding_window=3,
                 use_sliding_window=True)
    assert cfg.sliding_window == 3
    windowed = 1 + 2 + (3 + 3 + 3) * 2  # at most 3 keys per token
    by_hand = (PROJECTIONS + MLP) * 8 * 2 + PER_PAIR * (27 + windowed) + LM_HEAD * 4
    assert perf.forward_flops(cfg, row.position_ids, row.num_trained) == by_hand


def test_a_moe_layer_counts_the_router_and_only_the_routed_experts(row):
    """Qwen3-MoE: per token the router (hidden x experts) and the experts it is routed to
    (gate, up, down each), not all of them."""
    from transformers import Qwen3MoeConfig

    experts, routed, moe_ffn = 8, 2, 32
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         num_experts=experts, num_experts_per_tok=routed,
                         moe_intermediate_size=moe_ffn)
    moe = 2 * (3 * D * moe_ffn * routed + D * experts)
    by_hand = LAYERS * ((PROJECTIONS + moe) * 8 + PER_PAIR * 27) + LM_HEAD * 4
    assert perf.forward_flops(cfg, row.position_ids, row.num_trained) == by_hand


def test_mfu_is_known_only_for_a_known_device_and_architecture(row):
    flops = perf.training_flops(config(), row.position_ids, row.num_trained)
    peak = perf.peak_flops_per_s("NVIDIA H200", "bf16")
    assert peak == 989.4e12
    assert perf.mfu(flops, 2.0, peak, num_devices=2) == pytest.approx(flops / (4 * 989.4e12))
    assert perf.peak_flops_per_s(None, "fp32") is None  # CPU: omitted
    assert perf.mfu(flops, 1.0, None) is None
    cfg = config()
    cfg.model_type = "gpt2"
    assert perf.training_flops(cfg, torch.arange(4), 1) is None
