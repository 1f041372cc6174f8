"""One gateway turn at the seam (`Gateway._sample`): the real template, tokenizer and tool-call
parser, a scripted sampler. What the agent is answered and what the rollout counts."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from grpo_agent.rollout.gateway import (
    AgentSession,
    Gateway,
    HarnessLimits,
    chat_logprobs,
    cut_at_stop,
    template_messages,
)
from grpo_agent.rollout.gateway_errors import GatewayError
from grpo_agent.rollout.reconcile import reconcile_turns
from grpo_agent.types import TurnRecord

TOOLS = [{"type": "function", "function": {
    "name": "increment", "description": "Increment the counter.",
    "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}}}}]
CALL = "<tool_call>\n" + json.dumps({"name": "increment", "arguments": {"step": 3}}) + "\n</tool_call>"
USER = [{"role": "user", "content": "Increment the counter by 3."}]


class Sampler:
    """generate_one_turn answering `text` with `finish`; records the max_tokens asked."""

    def __init__(self, tokenizer, text, finish):
        self.tokenizer, self.text, self.finish, self.max_tokens = tokenizer, text, finish, []

    async def __call__(self, prompt_ids, max_tokens):
        self.max_tokens.append(max_tokens)
        output = self.tokenizer.encode(self.text, add_special_tokens=False)
        return TurnRecord(prompt_ids, output, [-0.1] * len(output), finish_reason=self.finish)


def _turn(tokenizer, text=CALL, finish="stop", tool_choice=None, max_model_len=4096,
          max_tokens=64):
    sampler = Sampler(tokenizer, text, finish)
    loop = SimpleNamespace(tokenizer=tokenizer, tool_executor=None, generate_one_turn=sampler,
                           server=SimpleNamespace(max_model_len=max_model_len),
                           config=SimpleNamespace(chat_template_kwargs=None))
    session = AgentSession(version=0)
    message, finish, usage, _ = asyncio.run(
        Gateway(loop, HarnessLimits())._sample(session, USER, TOOLS, tool_choice, max_tokens))
    return message, finish, usage, session, sampler


def test_a_tool_call_is_answered_as_one_and_counted(tiny_tokenizer):
    message, finish, _, session, _ = _turn(tiny_tokenizer)
    assert finish == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"step": 3}
    assert session.tool_calls == 1 and session.parallel_calls == [1]


def test_tool_choice_none_leaves_the_text_unparsed(tiny_tokenizer):
    """tool_choice="none": the agent asked for text, so a call-shaped answer stays text."""
    message, finish, _, session, _ = _turn(tiny_tokenizer, tool_choice="none")
    assert finish == "stop" and "tool_calls" not in message
    assert "<tool_call>" in message["content"] and session.tool_calls == 0


def test_calls_in_a_turn_cut_off_by_length_are_not_counted(tiny_tokenizer):
    """As the tool loop counts: a turn that hit max_tokens did not finish writing its calls."""
    _, finish, _, session, _ = _turn(tiny_tokenizer, finish="length")
    assert finish == "length" and session.tool_calls == 0 and session.parallel_calls == []


def test_an_unreadable_call_is_answered_as_its_text_and_counted_malformed(tiny_tokenizer):
    """As in the tool loop: the agent sees what the model wrote (no call it cannot run) and the
    rollout counts the call and that it was malformed."""
    broken = '<tool_call>\n{"name": "increment", "arguments": {\n</tool_call>'
    message, finish, _, session, _ = _turn(tiny_tokenizer, text=broken)
    assert message == {"role": "assistant", "content": broken} and finish == "stop"
    assert session.tool_calls == 1 and session.malformed_calls == 1


def test_a_stop_cut_ends_at_the_earliest_stop_and_keeps_the_turn_trainable(tiny_tokenizer):
    """Two stop strings that end at the same token ("Observation:" holds "vation:"): the text
    ends before the one that starts first, as the OpenAI API cuts. The finish reason is `stop`
    even for a turn sampled to its length, and every per-token column is cut with the ids, so
    the recorded turn still reconciles into a training sequence."""
    ids = tiny_tokenizer.encode("Thought: add 3\nObservation: 7", add_special_tokens=False)
    n = len(ids)
    turn = TurnRecord([1, 2], ids, [-0.1] * n, output_mask=[1] * n,
                      output_sampling_mask=[[t] for t in ids],
                      output_sampler_logprobs=[{t: -0.1} for t in ids], finish_reason="length",
                      weight_versions=["v0"] * n)
    cut, reply, text = cut_at_stop(turn, tiny_tokenizer, ["vation:", "Observation:"])
    assert text == "Thought: add 3\n" and cut.finish_reason == "stop"
    kept = len(cut.output_ids)
    assert reply == tiny_tokenizer.decode(ids[:kept], skip_special_tokens=False)  # as recorded
    assert "Observation:" in reply and kept < n
    for column in (cut.output_log_probs, cut.output_mask, cut.output_sampling_mask,
                   cut.output_sampler_logprobs, cut.weight_versions):
        assert len(column) == kept
    (sequence,), _ = reconcile_turns([cut])
    assert sequence.num_trained == kept


def test_the_context_left_bounds_max_tokens_and_a_full_context_is_refused(tiny_tokenizer):
    _, _, (prompt_tokens, _), _, _ = _turn(tiny_tokenizer)
    *_, sampler = _turn(tiny_tokenizer, max_model_len=prompt_tokens + 1)
    assert sampler.max_tokens == [1]  # one token of room: asked for one, not 64
    with pytest.raises(GatewayError, match="Shorten the conversation") as refused:
        _turn(tiny_tokenizer, max_model_len=prompt_tokens)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"


def test_each_call_is_recorded_under_the_sessions_version_and_the_history_kept(tiny_tokenizer):
    """The rollout's sample is built from its first rendered messages and every turn, sampled
    at the session's version; the agent's parts-list content and developer role render as the
    tool loop's text and system turns, and empty tool arguments as {}."""
    from grpo_agent.rollout.versions import rollout_version

    versions = []
    sampler = Sampler(tiny_tokenizer, "Done.", "stop")

    async def generate(prompt_ids, max_tokens):
        versions.append(rollout_version())
        return await sampler(prompt_ids, max_tokens)

    loop = SimpleNamespace(tokenizer=tiny_tokenizer, tool_executor=None, generate_one_turn=generate,
                           server=SimpleNamespace(max_model_len=4096),
                           config=SimpleNamespace(chat_template_kwargs=None))
    gateway = Gateway(loop, HarnessLimits())
    session = AgentSession(version=7)
    first = [{"role": "user", "content": [{"type": "text", "text": "Increment "},
                                          {"type": "text", "text": "the counter."}]}]
    reply, _, _, _ = asyncio.run(gateway._sample(session, first, TOOLS, None, 64))
    call = {"id": "c1", "type": "function", "function": {"name": "increment", "arguments": ""}}
    second = [*first, {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    asyncio.run(gateway._sample(session, second, TOOLS, None, 64))
    assert versions == [7, 7]
    assert session.first_messages == [{"role": "user", "content": "Increment the counter."}]
    assert len(session.turns) == 2
    assert session.generated_tokens == sum(len(t.output_ids) for t in session.turns) > 0
    assert session.last_messages[:-1] == second
    assert session.last_messages[-1] == {"role": "assistant", "content": "Done."}
    assert reply == {"role": "assistant", "content": "Done."}
    rendered = tiny_tokenizer.decode(session.turns[1].prompt_ids)
    assert '"arguments": {}' in rendered and "Increment the counter." in rendered


def test_an_empty_reply_is_null_content(tiny_tokenizer):
    message, finish, _, _, _ = _turn(tiny_tokenizer, text="")
    assert message == {"role": "assistant", "content": None} and finish == "stop"


def test_an_end_of_text_token_is_not_part_of_the_reply(tiny_tokenizer):
    """A turn the sampler ended on the pad token (`<|endoftext|>`, a stop id of Qwen models)
    reads like one ended on `<|im_end|>`: the agent gets the text, not the token."""
    message, finish, _, _, _ = _turn(tiny_tokenizer, text="Done.<|endoftext|>")
    assert message == {"role": "assistant", "content": "Done."} and finish == "stop"


def test_a_reply_of_only_the_end_of_turn_token_lists_no_logprobs(tiny_tokenizer):
    """The end-of-turn token is not text the agent got, so an empty reply has no entries."""
    turn = TurnRecord([1], [tiny_tokenizer.eos_token_id], [-0.1])
    assert chat_logprobs(turn, tiny_tokenizer, 2) == {"content": [], "refusal": None}


def test_a_developer_message_is_rendered_as_the_system_message():
    """OpenAI's `developer` role (newer clients send it for instructions) is the template's
    `system`: chat templates know no `developer` role."""
    messages = template_messages([{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": "hi"}])
    assert [m["role"] for m in messages] == ["system", "user"]


def test_a_message_without_a_string_role_is_a_400(tiny_tokenizer):
    with pytest.raises(GatewayError) as raised:
        template_messages([{"content": "hi"}])
    assert raised.value.status == 400 and "messages[0]" in str(raised.value)


def test_non_text_parts_are_skipped_and_unreadable_arguments_kept_verbatim():
    """A parts list keeps only its dict parts' text; a call's arguments that are not JSON stay
    the string the model wrote (rendered verbatim), and every call is a function entry."""
    bad = {"id": "c1", "function": {"name": "f", "arguments": "{not json"}}
    messages = template_messages([
        {"role": "user", "content": ["stray", {"type": "text", "text": "go"}, {"type": "image_url"}]},
        {"role": "assistant", "content": "", "tool_calls": [bad]}])
    assert messages[0] == {"role": "user", "content": "go"}
    assert messages[1]["tool_calls"] == [{"type": "function",
                                         "function": {"name": "f", "arguments": "{not json"}}]


def test_a_reply_sent_back_unchanged_keeps_its_sampled_ids_and_an_edited_one_forks(tiny_tokenizer,
                                                                                   one_token_per_character):
    """The model sampled its replies as ids the tokenizer does not encode their text to. The
    agent sends each reply back as it got it: the next prompt keeps the sampled ids, so the
    conversation stays one sample training the tokens as sampled. A reply the agent edited
    is encoded from its text (the replies before it keep their ids): a fork."""
    from grpo_agent.rollout.agent import ConversationRenderer
    from grpo_agent.rollout.reconcile import reconcile_turns

    eos = tiny_tokenizer.eos_token_id
    outputs = [one_token_per_character(text) + [eos]
               for text in (CALL, "Counted to 3.", "Again.", "Edited.")]

    async def generate(prompt_ids, max_tokens):
        output = outputs.pop(0)
        return TurnRecord(prompt_ids, output, [-0.1] * len(output), finish_reason="stop")

    loop = SimpleNamespace(tokenizer=tiny_tokenizer, tool_executor=None, generate_one_turn=generate,
                           server=SimpleNamespace(max_model_len=4096),
                           config=SimpleNamespace(chat_template_kwargs={"enable_thinking": False}))
    gateway, session = Gateway(loop, HarnessLimits()), AgentSession(version=0)

    def call(messages):
        return asyncio.run(gateway._sample(session, messages, TOOLS, None, 64))[0]

    history = [*USER, call(USER)]
    history += [{"role": "tool", "tool_call_id": history[-1]["tool_calls"][0]["id"], "content": "3"}]
    history += [call(history), {"role": "user", "content": "And again?"}]
    assert history[3]["content"] == "Counted to 3."
    call(history)
    edited = [*history[:3], {"role": "assistant", "content": "Counted to 4."}, history[4]]
    call(edited)

    first, second, third, fork = session.turns
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    renderer = ConversationRenderer(tiny_tokenizer, TOOLS, {"enable_thinking": False}, rerenders=True)
    assert tiny_tokenizer.decode(third.prompt_ids) == renderer.prompt_text(template_messages(history))
    sequences, stats = reconcile_turns([first, second, third])
    assert (len(sequences), stats.num_forks, stats.drift_tokens) == (1, 0, [0, 0]), stats
    trained = [t for t, m in zip(sequences[0].token_ids, sequences[0].trained_mask) if m]
    assert trained == first.output_ids + second.output_ids + third.output_ids  # as sampled
    kept = first.prompt_ids + first.output_ids  # the reply the agent did not edit keeps its ids
    rest = renderer.prompt_text(template_messages(edited))[len(tiny_tokenizer.decode(kept)):]
    assert "Counted to 4." in rest and fork.prompt_ids == kept + tiny_tokenizer.encode(rest, add_special_tokens=False)
    assert reconcile_turns(session.turns)[1].num_forks == 1
