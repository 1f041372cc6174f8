"""Parsing tool calls out of generated text, behind a small parser interface.

Design decision: a parser turns one assistant turn's decoded text into the message content
plus an ordered list of calls; a call whose JSON cannot be read is kept as a `MalformedCall`
so the tool loop can answer it with an error message the model sees (a policy error, not a
crash). Parsers are registered by name (`register_tool_call_parser`) so plugins can add other
model families; `parser_for_template` picks one from what a chat template emits. Built in:
the Qwen/Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    """A well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]

    def as_message_entry(self) -> dict[str, Any]:
        """The OpenAI-style entry chat templates expect in `message["tool_calls"]`."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class MalformedCall:
    """A call block the parser could not read; `error` says why, for the model to see."""

    raw: str
    error: str


@dataclass
class ParsedTurn:
    """An assistant turn split into visible content and calls in the order they were emitted."""

    content: str
    calls: list[ToolCall | MalformedCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    """What a tool-call format plugin provides."""

    def parse(self, text: str) -> ParsedTurn: ...


class HermesToolCallParser:
    """`<tool_call>{json}</tool_call>` blocks (Qwen2.5, Qwen3, Qwen3.5, Hermes, our tiny model)."""

    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls = [self._read_call(match) for match in self._block.finditer(text)]
        first = text.find("<tool_call>")
        content = (text if first < 0 else text[:first]).rstrip()
        return ParsedTurn(content=content, calls=calls)

    @staticmethod
    def _read_call(match: re.Match) -> ToolCall | MalformedCall:
        raw = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            return MalformedCall(raw, "the <tool_call> block is not closed with </tool_call>")
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError as exc:
            return MalformedCall(raw, f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return MalformedCall(raw, 'the tool call must be an object with a string "name"')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return MalformedCall(raw, '"arguments" is a string that is not valid JSON')
        if not isinstance(arguments, dict):
            return MalformedCall(raw, '"arguments" must be a JSON object')
        return ToolCall(payload["name"], arguments)


_PARSERS: dict[str, type] = {"hermes": HermesToolCallParser}
# Marker a chat template emits -> parser name; first match wins.
_TEMPLATE_MARKERS: list[tuple[str, str]] = [("<tool_call>", "hermes")]


def register_tool_call_parser(name: str, parser_cls: type, template_marker: str | None = None) -> None:
    """Add a parser (e.g. from a plugin); `template_marker` lets templates select it."""
    if name in _PARSERS and _PARSERS[name] is not parser_cls:
        raise ValueError(f"A tool-call parser named {name!r} is already registered ({_PARSERS[name]!r}).")
    _PARSERS[name] = parser_cls
    if template_marker is not None:
        _TEMPLATE_MARKERS.insert(0, (template_marker, name))


def get_tool_call_parser(name: str) -> ToolCallParser:
    """Instantiate the parser registered under `name`."""
    if name not in _PARSERS:
        raise KeyError(f"Unknown tool-call parser {name!r}; registered: {sorted(_PARSERS)}.")
    return _PARSERS[name]()


def parser_for_template(chat_template: str | None) -> ToolCallParser:
    """Pick the parser whose call marker the template emits (Hermes when none matches)."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return get_tool_call_parser(name)
    return get_tool_call_parser("hermes")
