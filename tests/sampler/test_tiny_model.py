"""The tiny-model kit: deterministic, loadable by transformers, with a tool/think template."""
import hashlib

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_agent.testing import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tiny_model


def _digest(folder):
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in ("model.safetensors", "tokenizer.json", "config.json")}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_two_builds_produce_identical_files(tiny_model_path, tmp_path):
    fresh = build_tiny_model(tmp_path / "again")
    assert _digest(fresh) == _digest(tiny_model_path)


def test_cached_build_is_reused_without_rewriting(tiny_model_path):
    before = (tiny_model_path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model() == tiny_model_path
    assert (tiny_model_path / "model.safetensors").stat().st_mtime_ns == before


def test_model_is_a_float32_qwen3_of_about_a_million_parameters(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.model_type == "qwen3"
    assert str(model.dtype) == "torch.float32"
    assert 500_000 <= sum(p.numel() for p in model.parameters()) <= 2_000_000
    assert model.config.max_position_embeddings >= 2048


def test_tokenizer_has_the_chat_special_tokens(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert 1500 <= len(tokenizer) <= 4096
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [
            tokenizer.convert_tokens_to_ids(token)]
    text = "What is 12 + 7? The answer is 19."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_tools_calls_and_responses(tokenizer):
    tools = [{"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"x": 2}}}]},
        {"role": "tool", "content": "5"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"x": 2}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_keeps_thinking_only_after_the_last_user_query(tokenizer):
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA1"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "A2", "reasoning_content": "new reasoning"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "old reasoning" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\nA2<|im_end|>" in text
    no_think = tokenizer.apply_chat_template(messages[:1], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
