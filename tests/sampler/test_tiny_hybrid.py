"""The kit's tiny Gated DeltaNet hybrid (`--arch qwen3_5`): deterministic, Qwen3.5's layer
layout, the same tokenizer and chat template as the Qwen3 kit, loadable by transformers, and
tree-packable (packed == unpacked on a rendered chat)."""
import copy
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_agent.testing import build_tiny_model
from grpo_agent.train.forward import forward_row
from grpo_agent.train.packing import pack_row
from grpo_agent.train.tree_attention import enable_tree_attention
from grpo_agent.types import TrainingSample, TrainingSequence
from transformers import AutoModelForCausalLM, AutoTokenizer

FILES = ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja")


def _digest(folder, names=FILES):
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}


@pytest.fixture(scope="module")
def hybrid_path():
    return build_tiny_model(arch="qwen3_5")


def test_cli_build_is_identical_to_the_python_build(hybrid_path, tmp_path):
    out = tmp_path / "cli"
    script = Path(sys.executable).with_name("grpo-agent")
    subprocess.run([str(script), "tiny-model", str(out), "--arch", "qwen3_5"], check=True,
                   capture_output=True)
    assert _digest(out) == _digest(hybrid_path)


def test_real_layout_and_shared_tokenizer(hybrid_path, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(hybrid_path)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and str(model.dtype) == "torch.float32"
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.linear_num_value_heads > model.config.linear_num_key_heads
    assert 500_000 <= sum(p.numel() for p in model.parameters()) <= 2_000_000
    same = ("tokenizer.json", "chat_template.jinja")
    assert _digest(hybrid_path, same) == _digest(tiny_model_path, same)


def test_unknown_arch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="qwen3_5"):
        build_tiny_model(tmp_path / "x", arch="mamba")


def test_chat_rollouts_pack_exactly(hybrid_path):
    tokenizer = AutoTokenizer.from_pretrained(hybrid_path)
    plain = AutoModelForCausalLM.from_pretrained(hybrid_path).eval()
    packed = copy.deepcopy(plain)
    enable_tree_attention(packed)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False))
    samples = []
    for answer in ("5", "It is 5.", "<think>2 plus 3</think>5"):
        reply = tokenizer.encode(answer + "<|im_end|>")
        ids = prompt + reply
        mask = [0] * len(prompt) + [1] * len(reply)
        samples.append(TrainingSample(TrainingSequence(ids, mask, [-1.0] * len(ids)),
                                      advantage=1.0, model_version=0, group_id=0, row_index=0))
    got = forward_row(packed, pack_row(samples), temperature=1.0).token.logprobs
    ref = []
    for s in samples:
        logp = torch.log_softmax(plain(input_ids=torch.tensor([s.sequence.token_ids])).logits[0], -1)
        ref += [logp[t - 1, s.sequence.token_ids[t]]
                for t in range(1, s.num_tokens) if s.sequence.trained_mask[t]]
    torch.testing.assert_close(got, torch.stack(ref), atol=1e-5, rtol=0)
