"""The tool loop with the real tokenizer, template, parser and tools; only sampling is scripted."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import threading
from types import SimpleNamespace

import pytest
from grpo_agent.rollout.agent import run_tool_loop
from grpo_agent.rollout.observations import terminated
from grpo_agent.rollout.reconcile import reconcile_turns


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def lookup(key: str) -> dict:
    """
    Looks a key up.

    Args:
        key: The key.

    Returns:
        A record.
    """
    if key == "boom":
        raise RuntimeError("lookup table is on fire")
    if key == "bare":
        raise AssertionError  # as a bare `assert` raises it: no message
    return {"key": key, "thread": threading.current_thread().name, "ok": True}


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def run(loop, prompt="What is 3 times 4?", tools=(multiply, async_add, lookup)):
    return asyncio.run(run_tool_loop(loop, [{"role": "user", "content": prompt}], list(tools), group_id=0))


def test_sync_and_async_tools_run_and_results_feed_the_next_turn(scripted_loop):
    loop = scripted_loop([call("multiply", a=3, b=4), call("async_add", a=12, b=1), "It is 13."])
    rollout = run(loop)
    roles = [m["role"] for m in rollout.completion]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in rollout.completion if m["role"] == "tool"] == ["12", "13"]
    assert rollout.completion[0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    assert rollout.tool_call_count == 2 and rollout.tool_failure_count == 0
    assert len(rollout.turns) == 3
    assert rollout.completion_ids == [t for turn in rollout.turns for t in turn.output_ids]
    second_prompt = loop.tokenizer.decode(loop.prompts[1])
    assert "<tool_response>\n12\n</tool_response>" in second_prompt
    assert rollout.metrics["tools/multiply/call_count"] == [1.0]
    assert rollout.metrics["tools/async_add/failure_count"] == [0.0]
    assert rollout.metrics["tools/loop_exhausted_frac"] == [0.0]
    assert len(rollout.metrics["tools/latency_s"]) == 2


def test_tool_results_are_json_and_sync_tools_run_off_the_event_loop(scripted_loop):
    """Non-ASCII text stays itself in the JSON: the model reads "Zürich", not "Z\\u00fcrich"."""
    loop = scripted_loop([call("lookup", key="Zürich"), "done"])
    rollout = run(loop)
    result = json.loads(rollout.completion[1]["content"])  # JSON, not a Python repr
    assert result["ok"] is True and result["key"] == "Zürich"
    assert '"key": "Zürich"' in rollout.completion[1]["content"]
    assert result["thread"] != threading.main_thread().name


def test_policy_errors_become_tool_messages_and_are_counted(scripted_loop):
    bad_json = "<tool_call>\n{\"name\": \"multiply\", \"arguments\": {\"a\": 3,\n</tool_call>"
    turn = call("nope", x=1) + "\n" + bad_json + "\n" + call("lookup", key="boom") + "\n" + call("multiply", a=2, b=2)
    loop = scripted_loop([turn, "ok"])
    rollout = run(loop)
    tool_messages = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert len(tool_messages) == 4  # in the order emitted
    # a string name even for the unreadable call: a template that renders it must not print None
    assert all(isinstance(m["name"], str) for m in rollout.completion if m["role"] == "tool")
    assert "Unknown tool 'nope'" in tool_messages[0] and "multiply" in tool_messages[0]
    assert "not valid JSON" in tool_messages[1]
    assert json.loads(tool_messages[2]) == {"error": "RuntimeError: lookup table is on fire"}
    assert tool_messages[3] == "4"
    assert rollout.tool_call_count == 4 and rollout.tool_failure_count == 3
    assert rollout.metrics["tools/unknown_name_count"] == [1.0]
    assert rollout.metrics["tools/malformed_call_count"] == [1.0]
    assert rollout.metrics["tools/lookup/failure_count"] == [1.0]
    assert rollout.metrics["tools/parallel_calls_mean"] == [4.0]
    assert rollout.metrics["tools/failure_frequency"] == [1.0, 1.0, 1.0, 0.0]


def test_a_tool_error_without_a_message_is_named_without_a_dangling_colon(scripted_loop):
    rollout = run(scripted_loop([call("lookup", key="bare"), "ok"]))
    tool_messages = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert json.loads(tool_messages[0]) == {"error": "AssertionError"}


def test_an_unknown_tool_is_counted_apart_from_a_malformed_call(scripted_loop):
    rollout = run(scripted_loop([call("nope", x=1), "ok"]))
    assert rollout.metrics["tools/unknown_name_count"] == [1.0]
    assert rollout.metrics["tools/malformed_call_count"] == [0.0]


def recording_tool(seen: list):
    """A `record(tag)` tool that appends each tag it is called with to `seen`."""
    def record(tag: str) -> str:
        """
        Records a tag.

        Args:
            tag: The tag.
        """
        seen.append(tag)
        return tag

    return record


def test_calls_in_one_turn_run_in_order(scripted_loop):
    seen = []
    record = recording_tool(seen)
    loop = scripted_loop(["".join(call("record", tag=str(i)) for i in range(5)), "end"])
    run(loop, tools=[record])
    assert seen == ["0", "1", "2", "3", "4"]


def test_max_tool_calling_iterations_truncates_and_is_reported(scripted_loop):
    loop = scripted_loop([call("multiply", a=1, b=1)] * 5, max_tool_calling_iterations=2)
    rollout = run(loop)
    assert len(rollout.turns) == 3  # two executed rounds, then a turn still calling
    assert rollout.tool_call_count == 2
    assert rollout.metrics["tools/loop_exhausted_frac"] == [1.0]


def test_zero_tool_calling_iterations_is_one_turn_whose_calls_are_not_run(scripted_loop):
    """0 rounds (the spec's cap on tool-calling rounds): the first turn is sampled, its calls are
    not run, and the rollout counts as cut off at the cap; a turn without calls is not."""
    seen = []
    loop = scripted_loop([call("record", tag="never")] * 2, max_tool_calling_iterations=0)
    rollout = run(loop, tools=[recording_tool(seen)])
    assert (len(rollout.turns), rollout.tool_call_count, seen) == (1, 0, [])
    assert [m["role"] for m in rollout.completion] == ["assistant"]
    assert rollout.metrics["tools/loop_exhausted_frac"] == [1.0]
    answered = run(scripted_loop(["It is 12."], max_tool_calling_iterations=0))
    assert len(answered.turns) == 1 and answered.metrics["tools/loop_exhausted_frac"] == [0.0]


def test_patched_template_keeps_the_conversation_one_training_sequence(scripted_loop):
    thinking_call = "<think>\nUse the tool.\n</think>\n\n" + call("multiply", a=3, b=4)
    empty_think = "<think>\n\n</think>\n\n"  # a thinking model may think nothing
    loop = scripted_loop([thinking_call, empty_think + call("multiply", a=12, b=5), "<think>\nDone.\n</think>\n\n60"])
    rollout = run(loop)
    sequences, stats = reconcile_turns(rollout.turns)
    assert stats.num_transitions == 2
    assert stats.num_forks == 0, stats
    assert len(sequences) == 1
    assert sequences[0].num_trained == len(rollout.completion_ids)


def test_replies_keep_the_ids_they_were_sampled_as(scripted_loop, one_token_per_character):
    """The model sampled its turns as ids the tokenizer does not encode their text to (one token
    per character): each next prompt keeps them, so the rollout is one sample that trains the
    tokens as sampled."""
    loop = scripted_loop(["<think>\nUse the tool.\n</think>\n\n" + call("multiply", a=3, b=4),
                          "<think>\n\n</think>\n\nIt is 12."])
    loop.encode = one_token_per_character
    rollout = run(loop)
    first, second = rollout.turns
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    assert "<tool_response>\n12\n</tool_response>" in loop.tokenizer.decode(second.prompt_ids)
    sequences, stats = reconcile_turns(rollout.turns)
    assert (len(sequences), stats.num_forks) == (1, 0), stats
    trained = [t for t, m in zip(sequences[0].token_ids, sequences[0].trained_mask) if m]
    assert trained == rollout.completion_ids == first.output_ids + second.output_ids


def test_each_turn_is_decoded_once(scripted_loop, decode_counter):
    """One decode per turn gives both the text the turn is recorded under (for the next
    prompt's sampled ids) and the text parsed for calls."""
    loop = scripted_loop([call("multiply", a=3, b=4), "It is 12."])
    loop.tokenizer = decode_counter
    rollout = run(loop)
    assert decode_counter.decoded == [turn.output_ids for turn in rollout.turns]
    assert rollout.completion[-1] == {"role": "assistant", "content": "It is 12."}


RELEASE = threading.Event()  # set when a timeout test ends, so no sleeping tool outlives it


def slow_lookup(key: str) -> str:
    """
    Looks a key up, slowly.

    Args:
        key: The key.

    Returns:
        The value.
    """
    RELEASE.wait(5.0)
    return "late"


async def async_slow_lookup(key: str) -> str:
    """
    Looks a key up, slowly and asynchronously.

    Args:
        key: The key.

    Returns:
        The value.
    """
    await asyncio.sleep(5.0)
    return "late"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tool", [slow_lookup, async_slow_lookup])
def test_a_tool_past_tool_timeout_s_is_cut_off_and_the_model_told(scripted_loop, tool):
    """A tool still running after `tool_timeout_s` is abandoned: the rollout goes on at once
    with a failed call whose tool message says it timed out (the next turn's prompt has it)."""
    loop = scripted_loop([call(tool.__name__, key="x"), "It timed out."], tool_timeout_s=0.2)
    RELEASE.clear()
    try:
        rollout = run(loop, tools=(tool,))
    finally:
        RELEASE.set()
    assert rollout.metrics["tools/latency_s"][0] < 4.0  # not the tool's 5 s
    message = f"Tool '{tool.__name__}' timed out after 0.2 s."
    assert json.loads(rollout.completion[1]["content"]) == {"error": message}
    assert message in loop.tokenizer.decode(loop.prompts[1])
    assert rollout.tool_call_count == 1 and rollout.tool_failure_count == 1
    assert rollout.metrics[f"tools/{tool.__name__}/failure_count"] == [1.0]


def test_a_turn_cut_off_by_length_ends_the_loop_without_running_its_calls(scripted_loop):
    """A turn that hit max_completion_length (finish_reason "length") ends the rollout: its
    tool call is not run and no turn follows; the rollout counts as clipped, not exhausted."""
    ran = []
    record = recording_tool(ran)
    loop = scripted_loop([call("record", tag="a"), "never sampled"])
    scripted = loop.generate_one_turn

    async def cut_off(prompt_ids):
        return dataclasses.replace(await scripted(prompt_ids), finish_reason="length")

    loop.generate_one_turn = cut_off
    rollout = run(loop, tools=(record,))
    assert ran == [] and len(rollout.turns) == 1 and len(loop.prompts) == 1
    assert [m["role"] for m in rollout.completion] == ["assistant"]
    assert rollout.completion[0]["tool_calls"][0]["function"]["name"] == "record"
    assert rollout.tool_call_count == 0 and rollout.metrics["tools/loop_exhausted_frac"] == [0.0]
    assert not terminated(rollout)  # counted in completions/clipped_ratio


def _cut_by_length(turn):
    """The turn as the sampler returns one cut off by length: without its end-of-turn token."""
    return dataclasses.replace(turn, output_ids=turn.output_ids[:-1],
                               output_log_probs=turn.output_log_probs[:-1], finish_reason="length")


def test_only_the_stop_token_that_ends_a_turn_is_cut_from_its_text(scripted_loop, tiny_tokenizer):
    """The end-of-turn token is no text the model wrote; a pad token written mid-turn is, and
    stays (here in a turn cut off by length, which ends in no stop token)."""
    pad = tiny_tokenizer.pad_token
    texts = [f"First {pad} then more.", f"Cut {pad} off here."]
    loop = scripted_loop(texts)
    scripted = loop.generate_one_turn

    async def cut_off(prompt_ids):
        turn = await scripted(prompt_ids)  # ends in the end-of-turn token
        return turn if len(loop.prompts) == 1 else _cut_by_length(turn)

    loop.generate_one_turn = cut_off
    rollout = run(loop, tools=())
    assert rollout.completion == [{"role": "assistant", "content": texts[0]}]
    rollout = run(loop, tools=())
    assert rollout.completion == [{"role": "assistant", "content": texts[1]}]


def test_a_tokenizer_without_a_pad_token_reads_turns_with_and_without_a_stop_token(
        scripted_loop, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = None  # as Llama 3's and GPT-2's have none
    loop = scripted_loop(["Done.", "Cut off"])
    loop.tokenizer = tokenizer
    scripted = loop.generate_one_turn

    async def cut_off(prompt_ids):
        return _cut_by_length(await scripted(prompt_ids))

    assert run(loop, tools=()).completion == [{"role": "assistant", "content": "Done."}]
    loop.generate_one_turn = cut_off
    assert run(loop, tools=()).completion == [{"role": "assistant", "content": "Cut off"}]


def _with_context(loop, max_model_len: int):
    class Sampler:  # what the loop reads from the real SamplerClient
        async def model_info(self):
            return SimpleNamespace(id="tiny", max_model_len=max_model_len)

    loop.sampler = Sampler()
    return loop


def test_max_completion_length_bounds_each_turn_not_the_rollout(scripted_loop):
    """The spec: each turn adds at most max_completion_length tokens; with
    max_tool_calling_iterations=None the turns are not capped (here 3 turns of ~26 tokens
    under max_completion_length=40, every call executed)."""
    texts = [call("multiply", a=3, b=4), call("async_add", a=12, b=1), "It is 13."]
    rollout = run(scripted_loop(texts, max_completion_length=40))
    assert max(len(turn.output_ids) for turn in rollout.turns) <= 40
    assert sum(len(turn.output_ids) for turn in rollout.turns) > 40
    assert len(rollout.turns) == 3 and rollout.tool_call_count == 2
    assert rollout.completion[-1] == {"role": "assistant", "content": "It is 13."}
    assert rollout.metrics["rollout/context_full_frac"] == [0.0]


def test_the_loop_ends_cleanly_when_the_next_turn_cannot_fit_the_context(scripted_loop):
    """A turn starts only when its prompt plus max_completion_length fits max_model_len;
    otherwise the rollout ends after the last tool results and is counted."""
    texts = [call("multiply", a=3, b=4), call("async_add", a=12, b=1), "It is 13."]
    turn_tokens = 64
    prompts = [turn.prompt_ids for turn in run(scripted_loop(texts)).turns]
    max_model_len = len(prompts[1]) + turn_tokens  # the second turn fits exactly, the third not
    assert len(prompts[2]) < max_model_len  # the prompt alone would still fit
    loop = _with_context(scripted_loop(texts, max_completion_length=turn_tokens), max_model_len)
    rollout = run(loop)
    assert len(rollout.turns) == 2
    assert rollout.tool_call_count == 2  # the second turn's call ran before the rollout ended
    assert rollout.completion[-1]["role"] == "tool" and rollout.completion[-1]["content"] == "13"
    assert rollout.metrics["rollout/context_full_frac"] == [1.0]


def test_the_first_turn_is_sent_even_when_a_full_turn_would_not_fit(scripted_loop):
    """Only later turns are checked against the context: a first prompt that does not fit is
    the server's error to report, not an empty rollout."""
    rollout = run(_with_context(scripted_loop(["It is 12."], max_completion_length=64), 1))
    assert len(rollout.turns) == 1 and rollout.metrics["rollout/context_full_frac"] == [0.0]


def test_without_tools_a_tool_call_in_the_text_stays_one_turn(scripted_loop):
    text = "Let me try " + call("multiply", a=3, b=4)
    rollout = run(scripted_loop([text, "never sampled"]), tools=())
    assert len(rollout.turns) == 1
    assert rollout.completion == [{"role": "assistant", "content": text}]
    assert rollout.tool_call_count == 0


def test_a_malformed_call_keeps_the_raw_text_in_history(scripted_loop):
    broken = '<think>\n\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3\n</tool_call>'
    loop = scripted_loop([broken, "sorry"])
    rollout = run(loop)
    assert rollout.completion[0] == {"role": "assistant", "content": broken}
    assert broken in loop.tokenizer.decode(loop.prompts[1])
    _, stats = reconcile_turns(rollout.turns)
    assert stats.num_forks == 0


def huge(n: int) -> str:
    """
    Returns a huge text.

    Args:
        n: Its size in words.

    Returns:
        The text.
    """
    return "word " * n


def test_a_huge_tool_output_ends_the_rollout_instead_of_overflowing_the_context(scripted_loop):
    """A 250 kB tool result cannot fit the next turn: the rollout ends after it, counted, and no
    turn's prompt (what trains) exceeds the context."""
    max_model_len = 1024
    loop = _with_context(scripted_loop([call("huge", n=50_000), "never sampled"], max_completion_length=64),
                         max_model_len)
    rollout = run(loop, tools=(huge,))
    assert len(rollout.turns) == 1 and rollout.tool_call_count == 1 and rollout.tool_failure_count == 0
    assert len(rollout.completion[-1]["content"]) == 250_000
    assert rollout.metrics["rollout/context_full_frac"] == [1.0]
    assert all(len(turn.prompt_ids) + len(turn.output_ids) <= max_model_len for turn in rollout.turns)


def test_the_first_failure_of_each_tool_is_logged_with_its_traceback(scripted_loop, caplog, monkeypatch):
    """A plugin author's tool that raises on every call only showed in tools/*/failure_count
    and in the model's tool messages: nothing on the terminal said the tool was broken."""
    from grpo_agent.rollout import agent

    monkeypatch.setattr(agent, "_warned_tools", set(), raising=False)
    boom = call("lookup", key="boom")
    with caplog.at_level("WARNING", logger="grpo_agent.rollout.agent"):
        run(scripted_loop([boom + "\n" + boom, boom, "ok"]))
    warnings = [r for r in caplog.records if r.name == "grpo_agent.rollout.agent"]
    assert len(warnings) == 1, "logged once per tool, not per call"
    message = warnings[0].getMessage()
    assert "Tool 'lookup' raised RuntimeError: lookup table is on fire" in message
    assert "tools/lookup/failure_count" in message and "fix it" in message
    # Counted also for a rollout cut short (tests/agent/test_tool_metrics.py).
    assert "whatever becomes of its rollout (finished, or cut short with its group)" in message
    assert "test_tool_loop.py" in caplog.text  # the traceback points into the tool


def test_arguments_that_do_not_fit_the_tool_are_the_models_error_not_a_broken_tool(
        scripted_loop, caplog, monkeypatch):
    """A model's made-up argument (the counter demo's tiny model: `increment(action=...)`) was
    logged as a broken tool, with a traceback, on the terminal of a run that went on fine; the
    model now reads the tool's signature, and the failure is counted, as for an unknown name."""
    from grpo_agent.rollout import agent

    monkeypatch.setattr(agent, "_warned_tools", set(), raising=False)
    with caplog.at_level("WARNING", logger="grpo_agent.rollout.agent"):
        rollout = run(scripted_loop([call("multiply", a=3, b=4, c=5), call("multiply", a=3), "ok"]))
    assert rollout.tool_call_count == 2 and rollout.tool_failure_count == 2
    answers = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert "Tool 'multiply' takes multiply(a: int, b: int) -> int" in answers[0]
    assert "unexpected keyword argument 'c'" in answers[0]
    assert "missing a required argument: 'b'" in answers[1]
    assert not [r for r in caplog.records if r.name == "grpo_agent.rollout.agent"], caplog.text


@pytest.mark.timeout(30)
def test_the_first_timeout_of_a_sync_tool_says_its_thread_stays_busy(scripted_loop, caplog, monkeypatch):
    from grpo_agent.rollout import agent

    monkeypatch.setattr(agent, "_warned_tools", set(), raising=False)
    RELEASE.clear()
    try:
        with caplog.at_level("WARNING", logger="grpo_agent.rollout.agent"):
            run(scripted_loop([call("slow_lookup", key="x"), "late"], tool_timeout_s=0.2), tools=(slow_lookup,))
    finally:
        RELEASE.set()
    assert "Tool 'slow_lookup' timed out after 0.2 s (tool_timeout_s); a sync tool's thread cannot be " \
           "stopped" in caplog.text
