"""Prefix-preservation detection and the patched training templates, on real templates."""
from __future__ import annotations

import logging

from grpo_agent.rollout.chat_template import (
    KNOWN_PATCHES,
    check_prefix_preserving,
    choose_training_template,
    training_template_for,
)

QWEN3_SNIPPET = (
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and "
    "reasoning_content) %}<|im_start|>assistant\n<think>\n"
)
DEEPSEEK_SNIPPET = (
    "{%- if message['role'] == 'assistant' %}{% set content = content.split('</think>')[-1] %}"
    "{{'<｜Assistant｜>' + content}}"
)


def test_tiny_model_template_is_detected_as_rewriting_history(tiny_tokenizer):
    report = check_prefix_preserving(tiny_tokenizer)
    assert not report.preserving
    assert report.step == 5  # the second tool result drops the previous empty <think> block
    assert "<think>\n\n</think>" in report.before and "<think>\n\n</think>" not in report.after
    assert "rewrites character" in report.describe()


def test_qwen3_family_gets_a_patched_template_that_preserves_prefixes(tiny_tokenizer):
    for kwargs in ({}, {"enable_thinking": False}):
        chosen = choose_training_template(tiny_tokenizer, kwargs)
        assert chosen.family == "qwen3" and chosen.template != tiny_tokenizer.chat_template
        assert chosen.report.preserving
        assert check_prefix_preserving(tiny_tokenizer, chosen.template, kwargs).preserving


def test_prefix_preserving_template_is_kept_as_is(tiny_tokenizer):
    tokenizer = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = choose_training_template(tiny_tokenizer).template
    chosen = choose_training_template(tokenizer)
    assert chosen.template is None and chosen.report.preserving


def test_known_family_patches_recognise_the_official_constructs():
    qwen3, deepseek = KNOWN_PATCHES
    assert qwen3.matches(QWEN3_SNIPPET) and "loop.last" not in qwen3.apply(QWEN3_SNIPPET)
    assert deepseek.matches(DEEPSEEK_SNIPPET)
    assert "split('</think>')" not in deepseek.apply(DEEPSEEK_SNIPPET)
    assert not deepseek.matches(QWEN3_SNIPPET)


def test_the_swap_is_logged_once(tiny_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="grpo_agent.rollout.chat_template"):
        first = training_template_for(tiny_tokenizer, {"enable_thinking": True})
        second = training_template_for(tiny_tokenizer, {"enable_thinking": True})
    assert first is second
    messages = [r.getMessage() for r in caplog.records]
    assert sum("patched qwen3 training template" in m for m in messages) == 1
