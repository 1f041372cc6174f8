"""Prompt ids of the gateway's re-rendered conversations, each turn's text encoded once.

Why: the gateway re-renders an agent's whole conversation at every call (that is how it tells
an extended history from an edited one), and encoding the rendered text was most of its own
CPU per call (the tools block alone is hundreds of tokens, and it grows with the history).
A tokenizer matches its added tokens in the raw text before anything else and encodes the text
between them piece by piece, so text cut just before a turn-start token (`<|im_start|>`)
encodes as the concatenation of its pieces' encodings. Each piece (a turn, the tools block)
is encoded once and reused by every later call that renders it. A tokenizer whose added-token
flags do not guarantee this gets the whole text encoded, as before.
"""
from __future__ import annotations

from collections.abc import Iterator

TURN_MARKERS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>")
MAX_PIECES = 16384  # cached pieces per gateway; cleared when full (a clear is thread-safe)


def turn_marker(tokenizer) -> str | None:
    """The tokenizer's turn-start token if text may be cut before it (see the module docstring):
    a special added token matched verbatim (no strip, not normalized, specials not split) that
    no other added token contains or can straddle."""
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    added = {token.content: token for token in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    for marker in TURN_MARKERS:
        token = added.get(marker)
        if token is None:
            continue
        verbatim = (token.special and not token.normalized and not token.lstrip
                    and not token.rstrip and not token.single_word)
        if verbatim and not any(_overlaps(other, marker) for other in added if other != marker):
            return marker
        return None
    return None


def _overlaps(other: str, marker: str) -> bool:
    """Whether `other` could match across a cut before `marker` (or at it, longer than it)."""
    return marker in other or any(marker.startswith(other[k:]) for k in range(1, len(other)))


class PromptEncoder:
    """`tokenizer.encode(text, add_special_tokens=False)`, with the text's turns cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.marker = turn_marker(tokenizer)
        self._pieces: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        if self.marker is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = []
        for piece in _cut(text, self.marker):
            cached = self._pieces.get(piece)
            if cached is None:
                if len(self._pieces) >= MAX_PIECES:
                    self._pieces.clear()
                cached = self._pieces[piece] = self.tokenizer.encode(piece, add_special_tokens=False)
            ids.extend(cached)
        return ids


def _cut(text: str, marker: str) -> Iterator[str]:
    """`text` cut before every occurrence of `marker` (after the first character)."""
    start = 0
    while (cut := text.find(marker, start + 1)) >= 0:
        yield text[start:cut]
        start = cut
    yield text[start:]
