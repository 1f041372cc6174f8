"""Prefix-preservation detection and the patched training templates, on real templates."""
from __future__ import annotations

import logging

from grpo_agent.rollout.agent import ConversationRenderer
from grpo_agent.rollout.chat_template import (
    KNOWN_PATCHES,
    check_prefix_preserving,
    choose_training_template,
    multiply,
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
    assert chosen.report.describe() == "prefix-preserving: every render extends the previous one"


def test_earlier_think_blocks_are_dropped_at_a_new_user_query_and_the_patch_keeps_them(tiny_tokenizer):
    """A gateway agent's chat sends a new user message each call: the model's template drops
    the `<think>` block of every assistant turn before it, with or without tools."""
    for tools in (False, True):
        for kwargs in ({}, {"enable_thinking": False}):
            chosen = choose_training_template(tiny_tokenizer, kwargs, tools)
            assert chosen.family == "qwen3" and chosen.report.preserving, (tools, kwargs)
    report = check_prefix_preserving(tiny_tokenizer, None, {}, tools=False)
    assert (report.preserving, report.step, report.conversation) == (False, 3, "the chat without tools")
    assert "<think>\nMultiply.\n</think>" in report.before and "<think>" not in report.after
    assert "of the chat without tools rewrites" in report.describe()


def test_a_chat_without_tools_renders_its_history_as_sampled(tiny_tokenizer):
    """The gateway's renderer without tools uses the patched template: the next call's prompt
    extends the tokens held (prompt + reply + end of turn), as one training sequence needs."""
    renderer = ConversationRenderer(tiny_tokenizer, None, {}, rerenders=True)
    reply = "<think>\nCount.\n</think>\n\nOne."
    held = renderer.prompt_ids([{"role": "user", "content": "Count."}]) + tiny_tokenizer.encode(
        reply + tiny_tokenizer.eos_token, add_special_tokens=False)
    following = renderer.prompt_ids([{"role": "user", "content": "Count."}, {"role": "assistant", "content": reply},
                                     {"role": "user", "content": "Again."}])
    assert following[: len(held)] == held


def test_known_family_patches_recognise_the_official_constructs():
    qwen3, deepseek = KNOWN_PATCHES
    assert qwen3.matches(QWEN3_SNIPPET) and "loop.last" not in qwen3.apply(QWEN3_SNIPPET)
    assert "ns.last_query_index" not in qwen3.apply(QWEN3_SNIPPET)
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


# The qwen3 construct without the family's markers, and a template whose history is
# rewritten by something no patch edits (the message count at its end).
PATTERN_ONLY = "{%- for m in messages %}{%- if (loop.last or reasoning) %}[{{ m.content }}]{%- endif %}{%- endfor %}"
UNPATCHABLE = "{{ '<|im_start|><think>' }}" + PATTERN_ONLY + "{{ messages | length }}"


def _with_template(tiny_tokenizer, template):
    tokenizer = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = template
    return tokenizer


def test_a_template_is_patched_only_when_it_is_the_family_and_the_patch_preserves(tiny_tokenizer, caplog):
    """Without the family's markers the construct is not patched; with them, a patch that
    leaves the template rewriting history is not used: the model's template stays, with a
    warning."""
    for template in (PATTERN_ONLY, UNPATCHABLE):
        tokenizer = _with_template(tiny_tokenizer, template)
        assert not check_prefix_preserving(tokenizer).preserving
        chosen = choose_training_template(tokenizer)
        assert (chosen.template, chosen.family) == (None, None), template
        assert chosen.note.startswith("no patched template for this family")
    with caplog.at_level(logging.INFO, logger="grpo_agent.rollout.chat_template"):
        training_template_for(tokenizer)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_render_that_shortens_the_previous_one_diverges_where_it_ends(tiny_tokenizer):
    tokenizer = _with_template(tiny_tokenizer, "{{ 'x' * (10 - messages | length) }}")
    report = check_prefix_preserving(tokenizer)
    assert (report.preserving, report.step, report.position) == (False, 2, 8)
    assert (report.before, report.after) == ("x" * 9, "x" * 8)


def test_the_choice_is_remembered_per_template_kwargs(tiny_tokenizer):
    thinking = training_template_for(tiny_tokenizer, {"enable_thinking": True})
    plain = training_template_for(tiny_tokenizer, {"enable_thinking": False})
    assert plain is not thinking
    assert plain is training_template_for(tiny_tokenizer, {"enable_thinking": False})


# Qwen3-style: the generation prompt pre-fills an empty <think> block when thinking is off,
# but an assistant turn in history is rendered without it.
PREFILLED_PROMPT = (
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}{%- endfor %}{%- if add_generation_prompt %}"
    "<assistant>{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}"
)


def test_a_generation_prompt_the_rendered_reply_does_not_start_with_is_a_rewrite(tiny_tokenizer):
    """The sampler continues the prompt with its generation prompt; history that renders the
    reply without it rewrites tokens the model was conditioned on, though every history-only
    render extends the last."""
    tokenizer = _with_template(tiny_tokenizer, PREFILLED_PROMPT)
    report = check_prefix_preserving(tokenizer, None, {"enable_thinking": False}, tools=False)
    assert (report.preserving, report.step) == (False, 2)
    assert "<assistant><think>\n\n</think>" in report.before and "<think>" not in report.after


# Rewrites history only around tool results (the last one alone is shown), with the qwen3
# construct the patch edits: prefix-preserving in a chat without tools, patched with them.
TOOL_RESULTS_REWRITTEN = (
    "{{- '<|im_start|><think>' }}{%- for m in messages %}{%- set reasoning = false %}"
    "{%- if m.role == 'tool' %}{%- if (loop.last or reasoning) %}[{{ m.content }}]{%- endif %}"
    "{%- else %}{{ m.role }}: {{ m.content }}|{%- endif %}{%- endfor %}"
)


def test_the_choice_without_tools_is_not_reused_for_conversations_with_tools(tiny_tokenizer):
    """A gateway chat without tools keeps the model's template; a tool loop on the same model
    afterwards must still get the patched one, or every tool result forks."""
    tokenizer = _with_template(tiny_tokenizer, TOOL_RESULTS_REWRITTEN)
    assert ConversationRenderer(tokenizer, None, {}, rerenders=True).template is None
    with_tools = ConversationRenderer(tokenizer, [multiply], {})
    assert with_tools.template is not None
    assert check_prefix_preserving(tokenizer, with_tools.template).preserving


SYSTEM_REQUIRED = (
    "{%- if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}"
    "{%- endif %}{%- for m in messages %}<{{ m.role }}>{{ m.content }}{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{%- endif %}"
)


def test_a_template_that_cannot_render_the_scripted_chat_is_kept_for_chats_without_tools(tiny_tokenizer):
    """The gateway renders an agent's own messages, which such a template may accept: the check
    cannot run, so the model's template is kept, saying why, instead of refusing every call."""
    tokenizer = _with_template(tiny_tokenizer, SYSTEM_REQUIRED)
    chosen = choose_training_template(tokenizer, {}, tools=False)
    assert chosen.template is None
    assert chosen.note.endswith("could not render a scripted chat to check: TemplateError)")
    renderer = ConversationRenderer(tokenizer, None, {}, rerenders=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    assert renderer.prompt_text(messages) == "<system>Be brief.<user>Hi.<assistant>"
