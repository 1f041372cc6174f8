"""The gateway's prompt encoder: cached turn pieces give exactly the tokenizer's ids."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from grpo_agent.rollout.agent import ConversationRenderer
from grpo_agent.rollout.gateway import template_messages
from grpo_agent.rollout.gateway_render import PromptEncoder, turn_marker

TOOL = {"type": "function", "function": {
    "name": "increment", "description": "Increment the internal counter.",
    "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}, "required": ["step"]}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "increment", "arguments": '{"step": 3}'}}
AWKWARD = [
    "Increment the counter by 3.",
    "trailing spaces   ",
    "ends in a combining accent e\u0301",
    "a literal <|im_start|>user marker and <|im_end|> inside",
    "<|im_start|>at the start",
    "tabs\tand\n\nnewlines\n",
    "emoji \U0001f600 and CJK \u4e2d\u6587",
    "",
]


def conversations():
    for text in AWKWARD:
        yield [{"role": "user", "content": text}], None
        yield [{"role": "system", "content": text}, {"role": "user", "content": "hi"}], None
        yield [{"role": "user", "content": "go"},
               {"role": "assistant", "content": text, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "c1", "content": text or "3"},
               {"role": "assistant", "content": "Done." + text},
               {"role": "user", "content": text}], [TOOL]


def test_cached_pieces_encode_exactly_as_the_whole_text(tiny_tokenizer):
    encoder = PromptEncoder(tiny_tokenizer)
    assert encoder.marker == "<|im_start|>"  # the cached path is the one under test
    for kwargs in ({}, {"enable_thinking": False}):
        for messages, tools in conversations():
            renderer = ConversationRenderer(tiny_tokenizer, tools, kwargs, rerenders=True)  # as the gateway
            text = renderer.prompt_text(template_messages(messages))
            expected = tiny_tokenizer.encode(text, add_special_tokens=False)
            assert encoder.encode(text) == expected, text  # pieces encoded now
            assert encoder.encode(text) == expected, text  # pieces from the cache
    assert encoder._pieces  # it did cache
    for text in ("", "no marker at all", "x<|im_start|>", "<|im_start|><|im_start|>"):
        assert encoder.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)


def _token(content, **flags):
    values = {"special": True, "normalized": False, "lstrip": False, "rstrip": False,
              "single_word": False, **flags}
    return SimpleNamespace(content=content, **values)


@pytest.mark.parametrize("tokens, expected", [
    ([_token("<|im_start|>"), _token("<|im_end|>")], "<|im_start|>"),
    ([_token("<|im_start|>", lstrip=True)], None),  # would eat the text before the cut
    ([_token("<|im_start|>", normalized=True)], None),
    ([_token("<|im_start|>", rstrip=True)], None),  # would eat the text after the cut
    ([_token("<|im_start|>", single_word=True)], None),  # matched depending on its neighbours
    ([_token("<|im_start|>", special=False)], None),
    ([_token("<|im_start|>"), _token("\n<|im")], None),  # could match across the cut
    ([_token("<|im_start|>"), _token("<|im_start|>user")], None),  # longer, at the cut
    ([_token("<|endoftext|>")], None),  # no turn marker: the whole text is encoded
    ([_token("<|start_header_id|>"), _token("<|eot_id|>")], "<|start_header_id|>"),  # Llama 3
    ([_token("<start_of_turn>"), _token("<end_of_turn>")], "<start_of_turn>"),  # Gemma
])
def test_the_text_is_cut_only_where_the_tokenizer_flags_guarantee_it(tokens, expected):
    tokenizer = SimpleNamespace(added_tokens_decoder=dict(enumerate(tokens)))
    assert turn_marker(tokenizer) == expected
    tokenizer.split_special_tokens = True
    assert turn_marker(tokenizer) is None


@pytest.mark.parametrize("added, cuttable, text", [
    ("<|im", True, "a <|im<|im_start|>user\nhi<|im_start|>"),  # a prefix of the marker: the longest match wins
    ("x<", False, "x<|im_start|>user"),  # would match across the cut, by its last character
    ("a<|im_start|>b", False, "a<|im_start|>b"),  # holds the marker inside it
])
def test_an_added_token_that_could_match_across_a_cut_keeps_the_text_whole(tiny_model_path, added,
                                                                            cuttable, text):
    """With the real tokenizer: where the marker is kept, the pieces encode as the whole text;
    where it is refused, cutting `text` before the marker would have changed its ids."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_tokens([AddedToken(added, special=True, normalized=False)], special_tokens=True)
    whole = tokenizer.encode(text, add_special_tokens=False)
    cut = text.index("<|im_start|>", 1)
    pieces = [*tokenizer.encode(text[:cut], add_special_tokens=False),
              *tokenizer.encode(text[cut:], add_special_tokens=False)]
    assert (turn_marker(tokenizer) == "<|im_start|>") == cuttable
    assert (pieces == whole) == cuttable
    assert PromptEncoder(tokenizer).encode(text) == whole


def test_a_full_piece_cache_is_cleared_and_still_encodes_exactly(tiny_tokenizer, monkeypatch):
    from grpo_agent.rollout import gateway_render

    monkeypatch.setattr(gateway_render, "MAX_PIECES", 2)
    encoder = PromptEncoder(tiny_tokenizer)
    for n in range(4):
        text = "".join(f"<|im_start|>user\nturn {n}.{k}<|im_end|>\n" for k in range(3))
        assert encoder.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)
        assert len(encoder._pieces) <= 2
