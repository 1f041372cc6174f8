"""Prefix-preserving chat templates for the tool loop and the agent gateway.

Both re-render the whole conversation every turn. When a template renders earlier messages
differently once a message is appended (Qwen3 drops the empty `<think>` block of an assistant
turn that is no longer last, and every `<think>` block before the last user query;
R1-style DeepSeek templates drop reasoning from history), the next prompt rewrites tokens the
model already generated and fork reconciliation has to start a new training sequence.

Design decision: detect this by rendering a scripted conversation one message at a time (for
renders with tools, one with tool calls and a follow-up user query; without, a plain chat
of two queries, as a gateway agent sends) and checking that each render starts with the
previous one (text level, so the report can point at the character where they diverge). For known families we swap in a patched
training template, made by small textual edits of the model's own template rather than a
shipped copy, and verify the patch with the same check; the swap is logged once per template.
The patched template keeps every assistant turn's reasoning in history, so the policy is
trained on the context it sampled in, not on the shorter one the model's template would show
at inference.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def _think(thinking: bool):
    return (lambda text: f"<think>\n{text}\n</think>\n\n") if thinking else (lambda text: "")


def scripted_tool_conversation(thinking: bool = True) -> list[dict[str, Any]]:
    """A user query, two tool-calling turns with their results, an answer, a follow-up user
    query and its answer.

    With `thinking`, three assistant turns reason inside `<think>`; without (the template was
    asked for `enable_thinking=False`), no turn does, as a model prompted that way would.
    """
    think = _think(thinking)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    return [
        {"role": "user", "content": "What is 3 times 4, then times 5?"},
        {"role": "assistant", "content": think("Use the tool."), "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {
            "name": "multiply", "arguments": {"a": 12, "b": 5}}}]},
        {"role": "tool", "name": "multiply", "content": "60"},
        {"role": "assistant", "content": think("Done.") + "The answer is 60."},
        {"role": "user", "content": "And halved?"},
        {"role": "assistant", "content": think("60 / 2.") + "30."},
    ]


def scripted_chat(thinking: bool = True) -> list[dict[str, Any]]:
    """Two user queries and their answers, no tools: a multi-turn chat through the gateway."""
    think = _think(thinking)
    return [
        {"role": "user", "content": "What is 3 times 4?"},
        {"role": "assistant", "content": think("Multiply.") + "12."},
        {"role": "user", "content": "And times 5?"},
        {"role": "assistant", "content": think("12 * 5.") + "60."},
    ]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


@dataclass
class PrefixReport:
    """Whether a template is prefix-preserving and, if not, where it first diverges."""

    preserving: bool
    step: int | None = None  # number of messages rendered when the divergence showed up
    position: int | None = None  # character offset in the earlier render
    before: str = ""  # the earlier render around the divergence
    after: str = ""  # the later render around the divergence
    conversation: str = ""  # which scripted conversation diverged

    def describe(self) -> str:
        if self.preserving:
            return "prefix-preserving: every render extends the previous one"
        return (
            f"not prefix-preserving: adding message {self.step} of {self.conversation} rewrites "
            f"character {self.position} of the earlier render\n  before: {self.before!r}\n"
            f"  after:  {self.after!r}"
        )


def _render(tokenizer, messages, tools, template, generation_prompt, template_kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False,
        add_generation_prompt=generation_prompt, **template_kwargs,
    )


def check_prefix_preserving(
    tokenizer, template: str | None = None, template_kwargs: dict | None = None, tools: bool = True
) -> PrefixReport:
    """Render the scripted tool conversation (`tools`) or the scripted chat without tools
    message by message; every render must extend the last.

    Renders alternate between "prompt" (history + generation prompt, what the sampler sees
    before an assistant turn) and "history" (after the assistant turn or tool result), which
    is exactly the sequence of texts the tool loop and the gateway produce.
    """
    kwargs = dict(template_kwargs or {})
    thinking = kwargs.get("enable_thinking") is not False
    if tools:
        name, messages, schemas = "the tool conversation", scripted_tool_conversation(thinking), [multiply]
    else:
        name, messages, schemas = "the chat without tools", scripted_chat(thinking), None
    previous = ""
    for count in range(1, len(messages) + 1):
        prompt_before_assistant = messages[count - 1]["role"] == "assistant"
        renders = []
        if prompt_before_assistant:
            renders.append((count - 1, _render(tokenizer, messages[: count - 1], schemas, template, True, kwargs)))
        renders.append((count, _render(tokenizer, messages[:count], schemas, template, False, kwargs)))
        for step, text in renders:
            if not text.startswith(previous):
                position = next(
                    (i for i, (a, b) in enumerate(zip(previous, text)) if a != b), len(text)
                )
                return PrefixReport(
                    False, step, position,
                    previous[max(0, position - 40): position + 40],
                    text[max(0, position - 40): position + 40], name,
                )
            previous = text
    return PrefixReport(True)


@dataclass(frozen=True)
class TemplatePatch:
    """A known family's non-prefix-preserving construct and its edit."""

    family: str
    markers: tuple[str, ...]  # all must appear in the template
    edits: tuple[tuple[str, str], ...]  # (regex, replacement)

    def matches(self, template: str) -> bool:
        return all(marker in template for marker in self.markers) and any(
            re.search(pattern, template) for pattern, _ in self.edits
        )

    def apply(self, template: str) -> str:
        for pattern, replacement in self.edits:
            template = re.sub(pattern, replacement, template)
        return template


KNOWN_PATCHES: tuple[TemplatePatch, ...] = (
    # Qwen3 / Qwen3.5 (and our tiny model): render the <think> block of every assistant turn,
    # not only the last one and those with non-empty reasoning after the last user query.
    TemplatePatch(
        "qwen3",
        ("<|im_start|>", "<think>"),
        (
            (r"loop\.last or \(not loop\.last and reasoning_content\)", "true"),
            (r"\(loop\.last or reasoning\)", "true"),
            (r"loop\.index0 > ns\.last_query(?:_index)?\b", "true"),
        ),
    ),
    # DeepSeek-V3 / R1 style: keep reasoning in history instead of cutting at </think>.
    TemplatePatch(
        "deepseek-v3",
        ("<｜Assistant｜>",),
        ((r"{%-?\s*set content = content\.split\('</think>'\)\[-1\]\s*-?%}", ""),),
    ),
)


@dataclass
class TrainingTemplate:
    """The template the tool loop and the gateway render with, and why it was chosen."""

    template: str | None  # None = the tokenizer's own template
    family: str | None
    report: PrefixReport
    note: str


def choose_training_template(
    tokenizer, template_kwargs: dict | None = None, tools: bool = True
) -> TrainingTemplate:
    """Keep the tokenizer's template if it is prefix-preserving, else patch a known family;
    `tools`: for conversations with tools (checked on the tool conversation) or without (on
    the plain chat)."""
    original = tokenizer.chat_template
    if not tools:  # a plain run renders with whatever template the model has: never refuse it
        try:
            report = check_prefix_preserving(tokenizer, None, template_kwargs, tools)
        except Exception as error:  # noqa: BLE001  (real messages show their own render error)
            return TrainingTemplate(None, None, PrefixReport(True), "the model's template (it could "
                                    f"not render a scripted chat to check: {type(error).__name__})")
    else:
        report = check_prefix_preserving(tokenizer, None, template_kwargs, tools)
    if report.preserving:
        return TrainingTemplate(None, None, report, "the model's template is prefix-preserving")
    for patch in KNOWN_PATCHES:
        if isinstance(original, str) and patch.matches(original):
            patched = patch.apply(original)
            patched_report = check_prefix_preserving(tokenizer, patched, template_kwargs, tools)
            if patched_report.preserving:
                return TrainingTemplate(
                    patched, patch.family, patched_report,
                    f"using the patched {patch.family} training template (the model's own "
                    "template is not prefix-preserving)",
                )
    return TrainingTemplate(
        None, None, report,
        "no patched template for this family: keeping the model's template; forks will add "
        "forward-pass tokens (see rollout/fork_frac)",
    )


_CHOSEN: dict[tuple[str, str, bool], TrainingTemplate] = {}


def training_template_for(
    tokenizer, template_kwargs: dict | None = None, tools: bool = True
) -> TrainingTemplate:
    """`choose_training_template`, memoised per template, kwargs and `tools`, logged once."""
    key = (str(tokenizer.chat_template), repr(sorted((template_kwargs or {}).items())), tools)
    if key not in _CHOSEN:
        chosen = choose_training_template(tokenizer, template_kwargs, tools)
        log = logger.info if chosen.report.preserving else logger.warning
        log("Chat template %s tools: %s. %s", "with" if tools else "without", chosen.note,
            chosen.report.describe())
        _CHOSEN[key] = chosen
    return _CHOSEN[key]
