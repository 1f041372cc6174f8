"""Shared helpers for agent tests: the tiny model's tokenizer and a scripted turn sampler."""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpo_agent.types import TurnRecord

# The spawned rollout worker imports the spec examples by module name.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from grpo_agent.testing import build_tiny_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model())


class ScriptedLoop:
    """The seam `run_tool_loop` talks to, with `generate_one_turn` replaying queued texts.

    The texts are tokenized with the real tokenizer (or `encode`, for ids the model may sample
    but the tokenizer never writes), so rendering, parsing and tool execution are the real code;
    only the sampler is scripted.
    """

    def __init__(self, tokenizer, texts: list[str], **config):
        self.tokenizer = tokenizer
        defaults = {"chat_template_kwargs": None, "max_tool_calling_iterations": None, "max_completion_length": 512,
                    "tool_timeout_s": 300.0}
        self.config = SimpleNamespace(**{**defaults, **config})
        self.tool_executor = ThreadPoolExecutor(4)
        self._texts = list(texts)
        self.prompts: list[list[int]] = []
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        self.prompts.append(prompt_ids)
        output = self.encode(self._texts.pop(0)) + [self.tokenizer.eos_token_id]
        return TurnRecord(prompt_ids, output, [-0.1] * len(output), finish_reason="stop")


class DecodeCounter:
    """The real tokenizer, the ids of each `decode` call recorded (the seam to count decodes)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.decoded = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids, **kwargs):
        self.decoded.append(list(ids))
        return self._tokenizer.decode(ids, **kwargs)


@pytest.fixture
def decode_counter(tiny_tokenizer):
    return DecodeCounter(tiny_tokenizer)


@pytest.fixture(scope="session")
def one_token_per_character(tiny_tokenizer):
    """`text` as ids a model may sample but the tokenizer never writes (it merges characters)."""
    def encode(text: str) -> list[int]:
        ids = [i for character in text for i in tiny_tokenizer.encode(character, add_special_tokens=False)]
        assert ids != tiny_tokenizer.encode(text, add_special_tokens=False), text  # not its own split
        return ids

    return encode


@pytest.fixture
def scripted_loop(tiny_tokenizer):
    loops = []

    def make(texts, **config):
        loop = ScriptedLoop(tiny_tokenizer, texts, **config)
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.tool_executor.shutdown(wait=False)
