"""The gateway over HTTP without a server: its routes, key check, request errors, reply and
stream shapes. The real template, tokenizer and tool-call parser; a scripted sampler at the
`generate_one_turn` seam (the real-vLLM paths are test_gateway_vllm.py)."""
from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import httpx
import pytest
from grpo_agent.rollout.gateway import SAMPLING_HEADER, Gateway, HarnessLimits
from grpo_agent.sampler.errors import SamplerError
from grpo_agent.types import TurnRecord

TOOL = {"type": "function", "function": {
    "name": "increment", "description": "Increment the counter.",
    "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}}}}
CALL = "<tool_call>\n" + json.dumps({"name": "increment", "arguments": {"step": 3}}) + "\n</tool_call>"
USER = [{"role": "user", "content": "Increment the counter by 3."}]


class Sampler:
    """generate_one_turn answering each call with the next scripted text (or raising it)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.max_tokens, self.prompts = tokenizer, list(texts), [], []

    async def __call__(self, prompt_ids, max_tokens):
        self.max_tokens.append(max_tokens)
        self.prompts.append(list(prompt_ids))
        text = self.texts.pop(0)
        if isinstance(text, Exception):
            raise text
        output = self.tokenizer.encode(text, add_special_tokens=False)
        ranked = [{token: -0.1, token + 1: -2.5, token + 2: -3.0} for token in output]  # top-3
        return TurnRecord(prompt_ids, output, [-0.1] * len(output), output_sampler_logprobs=ranked,
                          finish_reason="stop")


def serve(tokenizer, texts=(), requests=None, chat_template_kwargs=None, limits=None):
    """Start a gateway on a scripted loop, open a session, run `requests(http, gateway,
    session)` with an httpx client carrying the session's key, stop; returns its result,
    the session and the sampler."""
    sampler = Sampler(tokenizer, texts)
    loop = SimpleNamespace(tokenizer=tokenizer, tool_executor=None, generate_one_turn=sampler,
                           model_name="m", server=SimpleNamespace(max_model_len=4096, model_id="served-m"),
                           config=SimpleNamespace(chat_template_kwargs=chat_template_kwargs,
                                                  max_completion_length=64))

    async def main():
        gateway = Gateway(loop, limits or HarnessLimits())
        await gateway.start()
        session = gateway.open_session(0)
        try:
            async with httpx.AsyncClient(base_url=gateway.base_url,
                                         headers={"Authorization": f"Bearer {session.key}"}) as http:
                return await requests(http, gateway, session), session
        finally:
            await gateway.stop()

    result, session = asyncio.run(main())
    return result, session, sampler


def test_only_a_live_sessions_key_is_let_in_and_models_lists_both_names(tiny_tokenizer):
    """The scheme is case-insensitive and spaces around the key do not matter; an unknown key,
    or a closed session's, is a 401 naming OPENAI_API_KEY with OpenAI's type and code."""
    async def requests(http, gateway, session):
        auth = {"lower": f"bearer {session.key}", "spaced": f"Bearer   {session.key}"}
        listed = {name: await http.get("/models", headers={"Authorization": value})
                  for name, value in auth.items()}
        wrong = await http.get("/models", headers={"Authorization": "Bearer grpo-nope"})
        gateway.close_session(session)
        closed = await http.post("/chat/completions", json={"model": "m", "messages": USER})
        return listed, wrong, closed

    (listed, wrong, closed), session, sampler = serve(tiny_tokenizer, requests=requests)
    for reply in listed.values():
        assert reply.status_code == 200
        assert reply.json()["data"] == [
            {"id": name, "object": "model", "owned_by": "grpo-agent", "max_model_len": 4096}
            for name in ("m", "served-m")]
    for reply in (wrong, closed):
        assert reply.status_code == 401
        error = reply.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert "OPENAI_API_KEY" in error["message"]
    assert sampler.prompts == [] and session.rejected_calls == 0  # a stranger's call is not its


@pytest.mark.parametrize("body, status, param, says", [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    ({"model": "other", "messages": USER}, 404, "model", "'other' does not exist here"),
    ({"model": "m", "messages": USER, "n": 2}, 400, "n", "Only n=1"),
    ({"model": "m", "messages": USER, "tools": "increment"}, 400, "tools", "must be a list"),
    ({"model": "m", "messages": USER, "tools": {"type": "function"}}, 400, "tools", "must be a list"),
    ({"model": "m", "messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function",
     'tools[0].function must be an object ({"name": ...'),
    ({"model": "m", "messages": USER, "tools": [TOOL, "increment"]}, 400, "tools[1].function",
     'tools[1] is "increment"'),
    ({"model": "m", "messages": USER, "tools": [{"type": "function", "function": {"parameters": {}}}]},
     400, "tools[0].function.name", "must be a non-empty string (the function's name), got null"),
    ({"model": "m", "messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
     400, "tools[0].function.name", 'must be a non-empty string (the function\'s name), got ""'),
    ({"model": "m", "messages": USER, "stop": ["Observation:", ""]}, 400, "stop",
     'stop must be a non-empty string or a list of them, got ["Observation:", ""]'),
    ({"model": "m", "messages": USER, "stop": 3}, 400, "stop", "got 3"),
    ({"model": "m", "messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    ({"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "integer from 0 to 20, got 21"),
    ({"model": "m", "messages": USER, "logprobs": "yes"}, 400, "logprobs", "true or false"),
    ({"model": "m", "messages": "hi"}, 400, "messages", "non-empty list"),
    ({"model": "m", "messages": []}, 400, "messages", "non-empty list"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, 400, "messages", "got int"),
    ({"model": "m", "messages": [{"role": "system", "content": None}, *USER]}, 400, "messages",
     "could not render these messages: TypeError"),
    ({"model": "m", "messages": [*USER, {"role": "assistant", "tool_calls": "increment"}]}, 400,
     "messages[1].tool_calls", "must be a list of tool calls, got str"),
    ({"model": "m", "messages": [*USER, {"role": "assistant", "tool_calls": ["increment"]}]}, 400,
     "messages[1].tool_calls[0]", "must be an object with a 'function' object"),
    ({"model": "m", "messages": [*USER, {"role": "assistant", "tool_calls": [{"function": "x"}]}]},
     400, "messages[1].tool_calls[0]", "must be an object with a 'function' object"),
])
def test_a_bad_request_is_an_openai_error_counted_against_the_rollout(tiny_tokenizer, body, status,
                                                                      param, says):
    async def requests(http, gateway, session):
        sent = {"json": body} if isinstance(body, dict) else {"content": body}
        return await http.post("/chat/completions", **sent)

    reply, session, sampler = serve(tiny_tokenizer, requests=requests)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert says in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found" and "['m', 'served-m']" in error["message"]
    assert session.rejected_calls == 1 and session.in_flight == 0 and sampler.prompts == []
    assert session.last_rejection.startswith(f"{status} ") and says in session.last_rejection


def test_a_sampler_failure_is_a_502_server_error(tiny_tokenizer):
    async def requests(http, gateway, session):
        return await http.post("/chat/completions", json={"model": "m", "messages": USER})

    reply, session, _ = serve(tiny_tokenizer, [SamplerError("engine died")], requests)
    assert reply.status_code == 502
    assert "x-should-retry" not in reply.headers  # only a 4xx tells the SDK not to retry
    error = reply.json()["error"]
    assert error["type"] == "server_error" and "The sampler failed: engine died" in error["message"]
    assert session.rejected_calls == 1 and session.in_flight == 0
    assert str(session.sampler_error) == "engine died"  # the run checks it for a lost server


def test_a_reply_carries_the_sampling_note_usage_and_either_model_name(tiny_tokenizer):
    """max_completion_tokens wins over max_tokens; the served id is a name the gateway answers
    to; n=None is n=1."""
    async def requests(http, gateway, session):
        first = await http.post("/chat/completions", json={
            "model": "served-m", "messages": USER, "max_tokens": 9, "max_completion_tokens": 3, "n": None})
        second = await http.post("/chat/completions", json={  # a null newer name: not asked
            "model": "m", "messages": USER, "max_tokens": 5, "max_completion_tokens": None})
        return first, second

    (first, second), session, sampler = serve(tiny_tokenizer, ["Done.", "Done."], requests)
    assert first.status_code == second.status_code == 200
    assert first.headers[SAMPLING_HEADER] == "config (request temperature/top_p ignored)"
    body = first.json()
    assert body["object"] == "chat.completion" and body["model"] == "served-m"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Done."}
    prompt, completion = len(session.turns[0].prompt_ids), len(session.turns[0].output_ids)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    assert sampler.max_tokens == [3, 5]
    assert session.rejected_calls == 0 and session.in_flight == 0 and len(session.turns) == 2


def test_each_call_decodes_its_turn_once(decode_counter):
    """One decode of the turn gives both the text it is recorded under (for the next call's
    sampled ids) and the reply (without stop strings or logprobs, the only decode)."""
    async def requests(http, gateway, session):
        first = await http.post("/chat/completions", json={"model": "m", "messages": USER})
        again = [*USER, first.json()["choices"][0]["message"], {"role": "user", "content": "Again."}]
        return await http.post("/chat/completions", json={"model": "m", "messages": again})

    second, session, _ = serve(decode_counter, ["Done.", "Done again."], requests)
    assert second.json()["choices"][0]["message"]["content"] == "Done again."
    assert decode_counter.decoded == [turn.output_ids for turn in session.turns]


def test_chat_template_kwargs_given_as_json_text_render_as_the_dict(tiny_tokenizer):
    """The config may carry chat_template_kwargs as a JSON string (the CLI's form)."""
    async def requests(http, gateway, session):
        return await http.post("/chat/completions", json={"model": "m", "messages": USER})

    _, _, as_text = serve(tiny_tokenizer, ["Done."], requests,
                          chat_template_kwargs='{"enable_thinking": false}')
    _, _, as_dict = serve(tiny_tokenizer, ["Done."], requests,
                          chat_template_kwargs={"enable_thinking": False})
    assert as_text.prompts == as_dict.prompts
    assert tiny_tokenizer.decode(as_text.prompts[0]).endswith("<think>\n\n</think>\n\n")


def _events(text: str) -> list[tuple[str | None, str]]:
    """Server-sent events as (event name or None, data)."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), lines["data"]))
    return out


def test_a_streamed_chat_reply_is_role_and_text_then_each_call_then_finish_and_done(tiny_tokenizer):
    async def requests(http, gateway, session):
        return await http.post("/chat/completions", json={
            "model": "m", "messages": USER, "tools": [TOOL], "stream": True})

    reply, session, _ = serve(tiny_tokenizer, ["On it.\n" + CALL], requests)
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers[SAMPLING_HEADER].startswith("config")
    events = _events(reply.text)
    assert [name for name, _ in events] == [None] * 4 and events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "On it."}
    assert deltas[1]["tool_calls"][0]["index"] == 0
    assert json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"step": 3}
    assert deltas[2] == {} and chunks[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:2]] == [None, None]
    prompt, completion = len(session.turns[0].prompt_ids), len(session.turns[0].output_ids)
    assert chunks[2]["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                                  "total_tokens": prompt + completion}


def test_parallel_calls_stream_under_their_own_indexes(tiny_tokenizer):
    """The `openai` client assembles streamed tool calls by `index`: two calls in one turn
    must arrive as two calls, not one whose arguments are both glued together."""
    import openai

    two = CALL + "\n" + CALL.replace('"step": 3', '"step": 4')

    async def requests(http, gateway, session):
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key) as client:
            stream = await client.chat.completions.create(model="m", messages=USER, tools=[TOOL],
                                                          stream=True)
            return [delta.index for chunk in [c async for c in stream] if chunk.choices
                    for delta in chunk.choices[0].delta.tool_calls or []]

    indexes, session, _ = serve(tiny_tokenizer, [two], requests)
    assert indexes == [0, 1] and session.parallel_calls == [2] and session.tool_calls == 2


def test_responses_route_samples_as_a_chat_call_and_chains_and_streams(tiny_tokenizer):
    """`/v1/responses`: max_output_tokens bounds the turn, previous_response_id continues the
    rollout's own conversation, and a streamed response is named events ending with the
    response's status (no `[DONE]`)."""
    async def requests(http, gateway, session):
        first = await http.post("/responses", json={"model": "m", "input": "Count.", "max_output_tokens": 2})
        second = await http.post("/responses", json={
            "model": "m", "input": "Again.", "previous_response_id": first.json()["id"], "stream": True})
        return first, second

    (first, second), session, sampler = serve(tiny_tokenizer, ["One.", "Two."], requests)
    assert first.status_code == second.status_code == 200
    assert first.headers[SAMPLING_HEADER].startswith("config")
    assert first.json()["object"] == "response" and first.json()["status"] == "completed"
    assert first.json()["output"][0]["content"][0]["text"] == "One."
    assert sampler.max_tokens == [2, 64]
    rendered = tiny_tokenizer.decode(sampler.prompts[1])
    assert rendered.index("Count.") < rendered.index("One.") < rendered.index("Again.")
    events = _events(second.text)
    assert all(name is not None for name, _ in events) and "[DONE]" not in second.text
    payloads = [json.loads(data) for _, data in events]
    assert [name for name, _ in events] == [p["type"] for p in payloads]
    assert payloads[-1]["type"] == "response.completed"
    assert payloads[-1]["response"]["output"][0]["content"][0]["text"] == "Two."
    assert len(session.responses) == 2 and session.rejected_calls == 0


def test_both_routes_refuse_a_call_past_the_rollouts_budget(tiny_tokenizer):
    async def requests(http, gateway, session):
        chat = await http.post("/chat/completions", json={"model": "m", "messages": USER})
        over = [await http.post("/chat/completions", json={"model": "m", "messages": USER}),
                await http.post("/responses", json={"model": "m", "input": "Count."})]
        return chat, over

    (chat, over), session, sampler = serve(tiny_tokenizer, ["Done."], requests, limits=HarnessLimits(max_calls=1))
    assert chat.status_code == 200 and len(sampler.prompts) == 1
    for reply in over:
        assert reply.status_code == 429 and reply.json()["error"]["code"] == "rollout_call_budget"
    assert session.rejected_calls == 2


def test_the_agents_tools_and_tool_choice_decide_whether_a_reply_is_a_call(tiny_tokenizer):
    """A call-shaped reply is a call with tools offered (chat and Responses, whose response
    echoes them), and text with an empty tools list or tool_choice "none"."""
    flat = {"type": "function", **TOOL["function"]}

    async def requests(http, gateway, session):
        chat = {"model": "m", "messages": USER}
        return [await http.post("/chat/completions", json={**chat, "tools": [TOOL]}),
                await http.post("/chat/completions", json={**chat, "tools": []}),
                await http.post("/chat/completions", json={**chat, "tools": [TOOL], "tool_choice": "none"}),
                await http.post("/responses", json={"model": "m", "input": "Count.", "tools": [flat]}),
                await http.post("/responses", json={"model": "m", "input": "Count.", "tools": [flat],
                                                    "tool_choice": "none"})]

    replies, session, _ = serve(tiny_tokenizer, [CALL] * 5, requests)
    called, no_tools, told_not_to, responded, responded_text = (reply.json() for reply in replies)
    assert [item["type"] for item in responded_text["output"]] == ["message"]
    assert responded_text["tool_choice"] == "none"
    assert called["choices"][0]["finish_reason"] == "tool_calls"
    for body in (no_tools, told_not_to):
        assert body["choices"][0]["finish_reason"] == "stop"
        assert "<tool_call>" in body["choices"][0]["message"]["content"]
    assert [item["type"] for item in responded["output"]] == ["function_call"]
    assert responded["output"][0]["name"] == "increment" and responded["tools"] == [flat]
    assert session.tool_calls == 2


def test_the_unix_socket_serves_the_same_app_and_a_big_body_is_read(tiny_tokenizer):
    """Sandboxed command agents reach the gateway through its Unix socket; a request body
    over aiohttp's 1 MiB default (a long history) is read; stopping removes the socket."""
    async def requests(http, gateway, session):
        transport = httpx.AsyncHTTPTransport(uds=gateway.unix_path)
        async with httpx.AsyncClient(transport=transport, headers=http.headers) as local:
            listed = await local.get("http://gateway/v1/models")
        big = await http.post("/chat/completions", json={"model": "m", "messages": USER,
                                                          "metadata": {"note": "x" * (2 << 20)}})
        return listed, big, gateway.unix_path

    (listed, big, unix_path), _, _ = serve(tiny_tokenizer, ["Done."], requests)
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["m", "served-m"]
    assert big.status_code == 200
    assert not os.path.exists(os.path.dirname(unix_path))


def test_the_openai_client_does_not_retry_a_refusal(tiny_tokenizer):
    """The `openai` SDK with its default retries (a command agent's or a framework's own client)
    asks once past a spent budget: the gateway's 4xx says `x-should-retry: false`, so the agent
    gets the 429 at once and the rollout counts one refused call, not three."""
    import openai

    async def requests(http, gateway, session):
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key) as client:
            await client.chat.completions.create(model="m", messages=USER)
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(model="m", messages=USER)
            return refused.value

    refused, session, sampler = serve(tiny_tokenizer, ["Done."], requests, limits=HarnessLimits(max_calls=1))
    assert refused.response.headers["x-should-retry"] == "false"
    assert refused.code == "rollout_call_budget"
    assert session.rejected_calls == 1 and len(sampler.prompts) == 1


def test_stop_strings_end_the_reply_before_them_and_the_unseen_rest_is_not_trained(tiny_tokenizer):
    """A ReAct-style agent's `stop`: the text ends before the first stop string (finish reason
    `stop`, streamed too); the recorded turn keeps the sampled tokens up to and including the
    stop string, so the observation the model invented after it is neither shown nor trained.
    The token budget counts every sampled token."""
    react = "Thought: add 3\nAction: increment\nObservation: 7\nThought: done"

    async def requests(http, gateway, session):
        body = {"model": "m", "messages": USER, "stop": ["Observation:", "Final"]}
        return [await http.post("/chat/completions", json=body),
                await http.post("/chat/completions", json={**body, "stop": "\nAct", "stream": True}),
                await http.post("/chat/completions", json={**body, "stop": "absent"})]

    (plain, streamed, unmatched), session, _ = serve(tiny_tokenizer, [react] * 3, requests)
    reply = plain.json()
    assert reply["choices"][0]["message"]["content"] == "Thought: add 3\nAction: increment\n"
    assert reply["choices"][0]["finish_reason"] == "stop"
    kept = session.turns[0]
    decode = tiny_tokenizer.decode
    assert decode(kept.output_ids).startswith("Thought: add 3\nAction: increment\nObservation:")
    assert "Observation:" not in decode(kept.output_ids[:-1]) and "7" not in decode(kept.output_ids)
    assert len(kept.output_log_probs) == len(kept.output_ids) == reply["usage"]["completion_tokens"]
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Thought: add 3"
    assert unmatched.json()["choices"][0]["message"]["content"] == react
    whole = len(tiny_tokenizer.encode(react, add_special_tokens=False))
    assert len(session.turns[2].output_ids) == whole and session.generated_tokens == 3 * whole


def test_logprobs_are_the_sampled_ones_of_the_text_the_agent_got(tiny_tokenizer):
    """`logprobs: true` through the real `openai` client: one entry per token of the text the
    agent got (no end-of-turn token, no stop string) with the sampler's log-prob and, best
    first, `top_logprobs` of the candidates it recorded; not asked, null."""
    import openai

    text = "Thought: add 3\nAction: increment"

    async def requests(http, gateway, session):
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key) as client:
            create = client.chat.completions.create
            streamed = [chunk async for chunk in await create(
                model="m", messages=USER, logprobs=True, top_logprobs=2, stream=True)]
            return [await create(model="m", messages=USER, logprobs=True, top_logprobs=2),
                    await create(model="m", messages=USER, logprobs=True, stop="Action"),
                    await create(model="m", messages=USER), streamed]

    (whole, cut, plain, streamed), _, _ = serve(tiny_tokenizer, [text + "<|im_end|>"] * 2 + [text] * 2,
                                                requests)
    entries = whole.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == text == whole.choices[0].message.content
    for entry in entries:
        assert entry.logprob == -0.1 and bytes(entry.bytes).decode() == entry.token
        assert [t.logprob for t in entry.top_logprobs] == [-0.1, -2.5]
        assert entry.top_logprobs[0].token == entry.token
    shown = "".join(e.token for e in cut.choices[0].logprobs.content)
    assert cut.choices[0].message.content == "Thought: add 3\n" == shown
    assert all(e.top_logprobs == [] for e in cut.choices[0].logprobs.content)  # none asked
    assert plain.choices[0].logprobs is None
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [e.model_dump() for c in chunks for e in c.content] == [e.model_dump() for e in entries]
