"""The default multi-turn tool loop (`AsyncRolloutLoop.generate_one` with tools).

Each turn renders the whole conversation with the (training) chat template, samples one
assistant turn of at most `max_completion_length` tokens, parses its tool calls, runs them in
the order emitted and appends their results as tool messages, until a turn calls no tool,
`max_tool_calling_iterations` rounds have run (None: no cap; 0: the first turn's calls are not
run), the sampler stops on length or the next turn no longer fits the server's context
(`rollout/context_full_frac`). Without tools a turn is never parsed for calls: a plain
completion that happens to contain `<tool_call>` stays one turn.

Design decisions: everything the policy gets wrong (unknown tool, unreadable call JSON, a
tool that raises or times out) becomes a tool message the model sees and a counted failure,
never an exception; results are rendered as JSON, never Python `repr`. The first failure of
each tool in a process is also logged as a warning (with the traceback when it raised): the
model's messages are no place for a plugin author to find that their tool is broken. Sync tools run in the
worker's thread pool (`max_concurrent_rollouts` threads), async tools are awaited, and
template rendering also runs off the event loop. The one tool failure that stops the run: sync
calls that timed out and keep their threads holding most of the pool (`RolloutThreadPool`).
The `TurnRecord`s are returned untouched: fork reconciliation builds training sequences from
them later.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_agent.error_text import error_text
from grpo_agent.metrics import Observation
from grpo_agent.rollout import unfinished
from grpo_agent.rollout.chat_template import training_template_for
from grpo_agent.rollout.concurrency import RolloutThreadPool
from grpo_agent.rollout.sampled_turns import SampledTurns
from grpo_agent.rollout.tool_calls import MalformedCall, ParsedTurn, ToolCall, parser_for_template
from grpo_agent.types import Rollout, TurnRecord

logger = logging.getLogger(__name__)
_warned_tools: set[str] = set()  # tools whose first failure this process has logged


def render_tool_result(result: Any) -> str:
    """Strings go through as they are; anything else as JSON (never Python repr)."""
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)


def render_tool_error(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)


@dataclass
class ToolOutcome:
    """One executed (or refused) call: the tool message content and how it went."""

    name: str | None
    content: str
    failed: bool
    unknown_name: bool = False
    latency_s: float = 0.0


@dataclass
class _ToolStats:
    """Per-rollout `tools/*` observations, in the shape `Rollout.metrics` carries."""

    observations: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    per_tool_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    per_tool_failures: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    per_tool_cancelled: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: int = 0
    failures: int = 0
    unknown: int = 0
    malformed: int = 0

    def record(self, outcome: ToolOutcome) -> None:
        self.calls += 1
        self.failures += outcome.failed
        self.observations["tools/failure_frequency"].append(float(outcome.failed))
        if outcome.unknown_name:
            self.unknown += 1
        elif outcome.name is None:
            self.malformed += 1
        else:
            self.per_tool_calls[outcome.name] += 1
            self.per_tool_failures[outcome.name] += outcome.failed
            self.observations["tools/latency_s"].append(outcome.latency_s)
            self.observations[f"tools/{outcome.name}/latency_s"].append(outcome.latency_s)

    def cut_off(self, name: str) -> None:
        """A call of `name` cancelled mid-flight with its rollout: it was made, so it counts as
        a call; it has no outcome, so it is neither a failure nor in `tools/failure_frequency`."""
        self.per_tool_calls[name] += 1
        self.per_tool_cancelled[name] += 1

    def of_calls(self) -> dict[str, list[float]]:
        """The calls' own observations (per call, per turn) and counts: all that a rollout
        ending unfinished has (`tools/call_frequency`, `tools/loop_exhausted_frac` need its end)."""
        metrics = dict(self.observations)
        metrics["tools/unknown_name_count"] = [float(self.unknown)]
        metrics["tools/malformed_call_count"] = [float(self.malformed)]
        for name, count in self.per_tool_calls.items():
            metrics[f"tools/{name}/call_count"] = [float(count)]
            metrics[f"tools/{name}/failure_count"] = [float(self.per_tool_failures[name])]
        for name, count in self.per_tool_cancelled.items():
            metrics[f"tools/{name}/cancelled_count"] = [float(count)]
        return metrics

    def as_metrics(self, exhausted: bool) -> dict[str, list[float]]:
        return {**self.of_calls(), "tools/call_frequency": [float(self.calls)],
                "tools/loop_exhausted_frac": [float(exhausted)]}

    def so_far(self) -> list[Observation]:
        """`of_calls` for a rollout that did not return (`rollout.unfinished`), its failure
        frequency as `completion_observations` logs a finished one's: failures over calls."""
        if not self.calls and not self.per_tool_cancelled:
            return []
        ended = float(self.calls)  # a call cut off has no outcome: not in the rate
        rate = [("tools/failure_frequency", (float(self.failures), ended))] if ended else []
        return rate + [
            (name, value) for name, values in self.of_calls().items()
            if name != "tools/failure_frequency" for value in values]  # its 0/1s: in the rate


async def execute_tool_call(
    call: ToolCall | MalformedCall,
    tools_by_name: dict[str, Callable],
    executor,
    timeout_s: float,
) -> ToolOutcome:
    """Run one call; every policy or tool error comes back as a failed outcome, not a raise."""
    if isinstance(call, MalformedCall):
        return ToolOutcome(None, render_tool_error(f"Malformed tool call: {call.error}."), True)
    tool = tools_by_name.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools_by_name)) or "none"
        message = f"Unknown tool {call.name!r}. Available tools: {known}."
        return ToolOutcome(call.name, render_tool_error(message), True, unknown_name=True)
    owner = getattr(tool, "__self__", None)
    if isinstance(executor, RolloutThreadPool):
        if not inspect.iscoroutinefunction(tool):  # cancelled calls may hold most threads
            executor.check_held()
        late = executor.late_call_running(owner)
        if late is not None:  # two calls at once on one instance: neither result is to trust
            message = (f"Tool {call.name!r} was not run: the earlier call of {late!r} timed out "
                       "and still runs on the same environment.")
            return ToolOutcome(call.name, render_tool_error(message), True)
    misfit = _arguments_misfit(tool, call.arguments)
    if misfit is not None:  # the model's arguments, not the tool: no traceback on the terminal
        return ToolOutcome(call.name, render_tool_error(f"Tool {call.name!r} {misfit}."), True)
    started = time.perf_counter()
    in_thread = None  # a sync tool's call in the pool
    try:
        if inspect.iscoroutinefunction(tool):
            result = await asyncio.wait_for(tool(**call.arguments), timeout_s)
        else:
            in_thread = executor.submit(functools.partial(tool, **call.arguments))
            result = await asyncio.wait_for(asyncio.wrap_future(in_thread), timeout_s)
        content, failed = render_tool_result(result), False
    except asyncio.TimeoutError:
        content, failed = render_tool_error(f"Tool {call.name!r} timed out after {timeout_s:g} s."), True
        _warn_once(call.name, f"timed out after {timeout_s:g} s (tool_timeout_s)" + (
            "" if in_thread is None else
            "; a sync tool's thread cannot be stopped and stays busy until the tool returns"))
        if in_thread is not None and isinstance(executor, RolloutThreadPool):
            executor.busy_until_done(owner, in_thread, call.name)
            executor.hold(call.name, in_thread, timeout_s)  # raises once they hold most threads
    except asyncio.CancelledError:  # the rollout was cancelled: the thread may still run
        if in_thread is not None and isinstance(executor, RolloutThreadPool):
            executor.busy_until_done(owner, in_thread)
            executor.hold(call.name, in_thread, timeout_s, cancelled=True)  # counts, never raises
        raise
    except Exception as exc:  # noqa: BLE001  (a tool bug or bad arguments: the model sees it)
        content, failed = render_tool_error(error_text(exc)), True
        _warn_once(call.name, f"raised {error_text(exc)}", exc)
    return ToolOutcome(call.name, content, failed, latency_s=time.perf_counter() - started)


def _arguments_misfit(tool: Callable, arguments: dict) -> str | None:
    """Why `arguments` cannot be passed to `tool` (a name it lacks, a required one missing),
    else None. Checked before the call: the tool's own TypeError was logged as a broken tool,
    with a traceback, for a model that only made up an argument (`increment(action=...)`)."""
    try:
        signature = inspect.signature(tool)
    except (TypeError, ValueError):  # a builtin or C callable without one: the call decides
        return None
    try:
        signature.bind(**arguments)
    except TypeError as error:
        # annotations evaluated for the message only (`int`, not 'int', under
        # `from __future__ import annotations`): a call that fits pays nothing for them
        with contextlib.suppress(Exception):
            signature = inspect.signature(tool, eval_str=True)
        name = getattr(tool, "__name__", "tool")
        return f"takes {name}{signature}; the call's arguments do not fit: {error}"
    return None


def _warn_once(name: str, what: str, error: BaseException | None = None) -> None:
    if name in _warned_tools:
        return
    _warned_tools.add(name)
    logger.warning(
        "Tool %r %s. The model reads the error as the tool's answer; the call is counted in "
        "tools/%s/failure_count whatever becomes of its rollout (finished, or cut short with "
        "its group). If the tool is at fault rather than the model's arguments, fix it. Later "
        "failures of this tool are only counted.", name, what, name, exc_info=error)


def _strip_stop_tokens(text: str, tokenizer) -> str:
    for stop in (tokenizer.eos_token, tokenizer.pad_token):
        if stop and text.endswith(stop):
            return text[: -len(stop)]
    return text


class ConversationRenderer:
    """Renders messages to prompt ids with the training template (off the event loop).

    `rerenders`: whether the conversation's history is re-rendered turn after turn, so the
    prefix-preserving template is wanted (default: with tools, as in the tool loop, where a
    turn without tools is the last). The gateway passes True: an agent's multi-turn chat
    without tools re-renders too (Qwen3's own template drops the earlier replies' `<think>`
    blocks at each new user message: a fork per turn). A single-turn prompt keeps the model's
    own template."""

    def __init__(self, tokenizer, tools: list[Callable], template_kwargs: dict | None,
                 rerenders: bool | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        rerenders = bool(tools) if rerenders is None else rerenders
        chosen = training_template_for(tokenizer, self.template_kwargs, bool(tools)) if rerenders else None
        self.template = chosen.template if chosen else None
        self.parser = parser_for_template(self.template or tokenizer.chat_template)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.prompt_text(messages), add_special_tokens=False)

    def prompt(self, messages: list[dict], sampled: SampledTurns,
               encode: Callable[[str], list[int]] | None = None) -> tuple[str, list[int]]:
        """The prompt's text and ids, the replies sent back unchanged as they were sampled."""
        text = self.prompt_text(messages)
        return text, sampled.prompt_ids(text, encode or functools.partial(
            self.tokenizer.encode, add_special_tokens=False))

    def prompt_text(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=True, **self.template_kwargs,
        )


def _assistant_message(text: str, parsed: ParsedTurn) -> dict:
    """The turn as a chat message; with an unreadable call, the raw text stays as content.

    Re-rendering structured `tool_calls` could not reproduce a malformed block, so history
    would silently drop what the model wrote (and every next turn would fork).
    """
    if any(isinstance(call, MalformedCall) for call in parsed.calls):
        return {"role": "assistant", "content": text}
    message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [call.as_message_entry() for call in parsed.calls]
    return message


def _template_kwargs(config) -> dict:
    kwargs = getattr(config, "chat_template_kwargs", None) or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    return kwargs


async def _context_limit(loop) -> int | None:
    """The server's `max_model_len` when the loop has a sampler client (None otherwise)."""
    sampler = getattr(loop, "sampler", None)
    if sampler is None or not hasattr(sampler, "model_info"):
        return None
    return (await sampler.model_info()).max_model_len


def fits_context(prompt_tokens: int, turn_tokens: int, context_limit: int | None) -> bool:
    """Whether a turn's prompt plus a full turn (`max_completion_length`) fits the context.

    The first turn is always sent: a prompt that does not fit is the server's error to report.
    """
    return context_limit is None or prompt_tokens + turn_tokens <= context_limit


def _tool_stage(loop, call) -> Any:
    """The stall watch's `tool` stage; a seam without a watch (a test's loop) tracks nothing."""
    stalls = getattr(loop, "stalls", None)
    if stalls is None:
        return contextlib.nullcontext()
    return stalls.stage("tool", recover=True, tool=getattr(call, "name", None))


async def run_tool_loop(loop, prompt: list[dict], tools: list[Callable], group_id: int) -> Rollout:
    """Sample one multi-turn rollout; see the module docstring for the stopping rules."""
    config = loop.config
    executor = loop.tool_executor
    aio = asyncio.get_running_loop()
    renderer = await aio.run_in_executor(
        executor, ConversationRenderer, loop.tokenizer, tools, _template_kwargs(config)
    )
    tools_by_name = {tool.__name__: tool for tool in tools}
    max_rounds = getattr(config, "max_tool_calling_iterations", None)
    turn_tokens = getattr(config, "max_completion_length", None) or 0
    timeout_s = config.tool_timeout_s
    messages = [dict(m) for m in prompt]
    completion: list[dict] = []
    turns: list[TurnRecord] = []
    stats = _ToolStats()
    unfinished.record(stats.so_far)  # its calls count even if it never returns
    context_limit = await _context_limit(loop)
    rounds, exhausted, context_full = 0, False, False
    sampled = SampledTurns()
    while True:
        prompt_text, prompt_ids = await aio.run_in_executor(executor, renderer.prompt, messages, sampled)
        if turns and not fits_context(len(prompt_ids), turn_tokens, context_limit):
            context_full = True  # end cleanly after the last tool results (not a server error)
            break
        turn = await loop.generate_one_turn(prompt_ids)
        turns.append(turn)
        reply = loop.tokenizer.decode(turn.output_ids, skip_special_tokens=False)
        sampled.record(prompt_text, turn, reply)
        text = _strip_stop_tokens(reply, loop.tokenizer)
        parsed = renderer.parser.parse(text) if tools else ParsedTurn(text.rstrip())
        assistant = _assistant_message(text, parsed)
        messages.append(assistant)
        completion.append(assistant)
        if not parsed.calls or turn.finish_reason == "length":
            break
        if max_rounds is not None and rounds >= max_rounds:
            exhausted = True
            break
        stats.observations["tools/parallel_calls_mean"].append(float(len(parsed.calls)))
        for call in parsed.calls:  # in the order the model emitted them
            with _tool_stage(loop, call):
                try:
                    outcome = await execute_tool_call(call, tools_by_name, executor, timeout_s)
                except asyncio.CancelledError:  # only a known tool's call awaits: it ran
                    stats.cut_off(call.name)
                    raise
            stats.record(outcome)
            tool_message = {"role": "tool", "name": outcome.name or "invalid", "content": outcome.content}
            messages.append(tool_message)
            completion.append(tool_message)
        rounds += 1
    return Rollout(
        completion=completion,
        completion_ids=[t for turn in turns for t in turn.output_ids],
        turns=turns,
        tool_call_count=stats.calls,
        tool_failure_count=stats.failures,
        metrics={**stats.as_metrics(exhausted), "rollout/context_full_frac": [float(context_full)]},
    )
