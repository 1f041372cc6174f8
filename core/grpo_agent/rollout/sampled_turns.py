"""Prompt ids that keep the tokens the model sampled in earlier turns of a conversation.

Why: the gateway and the tool loop re-render the whole conversation as text at every turn.
Encoding that text gives the tokenizer's own split of each earlier reply, but a model may
sample another split of the same text (`increment`+`e` where the tokenizer writes "incremente"
as `incre`+`me`+`n`+`te`). The re-encoded prompt then no longer extends the sampled sequence:
the rollout forks, and the context the next turn is sampled in is not the one it was trained
in. So where the rendered text starts with an earlier turn's prompt text followed by the text
of its sampled ids (the agent sent that reply back unchanged), the prompt is that turn's
prompt ids, its sampled ids, then the rest of the text encoded. A reply the agent edited
renders other text, matches no turn and is encoded from its text: a fork, as it should be.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from grpo_agent.types import TurnRecord

# Turns looked up, the latest: a conversation continues its latest turn (an agent's parallel
# branches, a recent one). Bounds each lookup and the texts held in a session of many calls.
MAX_HELD = 64


class SampledTurns:
    """One conversation's (or agent session's) sampled turns, keyed by the text they decode to."""

    def __init__(self) -> None:
        self._held: deque[tuple[str, TurnRecord]] = deque(maxlen=MAX_HELD)

    def record(self, prompt_text: str, turn: TurnRecord, reply: str) -> None:
        """`turn` was sampled from the prompt rendered as `prompt_text`; `reply` is its output
        ids decoded with their special tokens (the caller's one decode of the turn)."""
        self._held.append((prompt_text + reply, turn))

    def prompt_ids(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """The ids of the rendered prompt `text`: the longest recorded turn it starts with, as
        sampled, then the rest encoded (all of it encoded when it starts with none)."""
        latest = list(self._held)  # a copy: the event loop may record a turn meanwhile
        for held, turn in sorted(latest, key=lambda entry: -len(entry[0])):
            if text.startswith(held):
                return [*turn.prompt_ids, *turn.output_ids, *encode(text[len(held):])]
        return encode(text)
