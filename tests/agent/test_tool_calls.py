"""The Hermes/Qwen tool-call parser and the parser registry."""
from __future__ import annotations

import pytest
from grpo_agent.rollout.tool_calls import (
    HermesToolCallParser,
    MalformedCall,
    ParsedTurn,
    ToolCall,
    get_tool_call_parser,
    parser_for_template,
    register_tool_call_parser,
)


def test_content_and_calls_are_split_in_order():
    text = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    parsed = HermesToolCallParser().parse(text)
    assert parsed.content == "Let me check."
    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})]


@pytest.mark.parametrize(
    "block, problem",
    [
        ('<tool_call>{"name": "a", "arguments": {</tool_call>', "not valid JSON"),
        ('<tool_call>["a"]</tool_call>', 'string "name"'),
        ('<tool_call>{"arguments": {"x": 1}}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "a", "arguments": {}}', "not closed"),
        ('<tool_call>{"name": "a", "arguments": "{x: 1"}</tool_call>', '"arguments" is a string that is not valid JSON'),
    ],
)
def test_unreadable_calls_are_kept_with_the_reason(block, problem):
    (call,) = HermesToolCallParser().parse(block).calls
    assert isinstance(call, MalformedCall) and problem in call.error


def test_a_call_without_arguments_calls_the_tool_with_none():
    """A call with no "arguments" key is a call of a tool that takes none, not malformed."""
    (call,) = HermesToolCallParser().parse('<tool_call>\n{"name": "now"}\n</tool_call>').calls
    assert call == ToolCall("now", {})


def test_text_without_calls_has_no_calls():
    assert HermesToolCallParser().parse("<think>\nhm\n</think>\n\n42") == ParsedTurn("<think>\nhm\n</think>\n\n42")


def test_plugins_can_register_a_parser_selected_by_template_marker():
    class BracketParser:
        def parse(self, text):
            return ParsedTurn(text, [])

    register_tool_call_parser("bracket-test", BracketParser, template_marker="[TOOL_CALLS]")
    assert isinstance(parser_for_template("... [TOOL_CALLS] ..."), BracketParser)
    assert isinstance(parser_for_template("<tool_call>"), HermesToolCallParser)
    with pytest.raises(ValueError, match="already registered"):
        register_tool_call_parser("bracket-test", HermesToolCallParser)
    with pytest.raises(KeyError, match="Unknown tool-call parser 'x'"):
        get_tool_call_parser("x")


def test_a_plugins_marker_wins_over_the_built_in_one_in_the_same_template():
    """A family whose calls sit inside `<tool_call>` in another format (Qwen3-Coder's
    `<function=...>` XML) registers its own marker: its template emits both, and the plugin's
    parser, not Hermes', must read it."""
    class XmlParser:
        def parse(self, text):
            return ParsedTurn(text, [])

    register_tool_call_parser("xml-function-test", XmlParser, template_marker="<function=")
    assert isinstance(parser_for_template("<tool_call>\n<function=multiply>"), XmlParser)
