"""A token-faithful OpenAI-compatible gateway, served by the rollout worker in its event loop.

An agent program talks to the policy through `/v1/chat/completions` as it would to any
OpenAI-compatible server. Each rollout gets its own random API key (`AgentSession`), so every
call is attributed to exactly one rollout and nothing else on the machine can write into it.

Design decision: the gateway never lets the sampler see text. A call renders the request's
messages with the training chat template (the prefix-preserving patched one, with tools or
without: every call re-renders the agent's history), samples token-in/token-out through the loop's
`generate_one_turn` (the config's sampling settings, the rollout's model version or adapter)
and records the exact prompt ids, generated ids, log-probs and top-k as a `TurnRecord`. The
text the agent gets back is only a view of those tokens; whatever history it sends next is
re-rendered (a reply sent back unchanged keeps the ids it was sampled as: `sampled_turns`), and
fork reconciliation decides whether it extends the sample or starts a new one. The request's
temperature/top_p are never used: the `x-grpo-agent-sampling` response header says so.
Streaming sends the finished turn as server-sent-event chunks.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace

from aiohttp import web

from grpo_agent.error_text import error_text
from grpo_agent.rollout import responses_api
from grpo_agent.rollout.agent import ConversationRenderer, _strip_stop_tokens
from grpo_agent.rollout.gateway_errors import GatewayError, check_tool_name
from grpo_agent.rollout.gateway_render import PromptEncoder
from grpo_agent.rollout.sampled_turns import SampledTurns
from grpo_agent.rollout.tool_calls import MalformedCall, ParsedTurn
from grpo_agent.sampler.errors import SamplerError
from grpo_agent.types import TurnRecord

SAMPLING_HEADER = "x-grpo-agent-sampling"
SAMPLING_NOTE = "config (request temperature/top_p ignored)"


@dataclass(frozen=True)
class HarnessLimits:
    """Per-rollout budgets and where the gateway listens (loopback unless told otherwise)."""

    timeout_s: float = 600.0  # wall time of one agent run
    max_calls: int | None = 64  # model calls per rollout
    max_generated_tokens: int | None = None  # generated tokens per rollout
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    # Command agents running at once (each is a process tree; the rollout cap is in the
    # hundreds). None: max(4, CPU count).
    max_commands: int | None = None


@dataclass
class AgentSession:
    """One rollout's view of the gateway: its key, model version, budgets and recorded calls."""

    version: int
    key: str = field(default_factory=lambda: "grpo-" + secrets.token_urlsafe(24))
    started: float = field(default_factory=time.monotonic)
    turns: list[TurnRecord] = field(default_factory=list)
    sampled: SampledTurns = field(default_factory=SampledTurns)  # the turns, by their text
    first_messages: list[dict] | None = None
    last_messages: list[dict] = field(default_factory=list)
    generated_tokens: int = 0
    rejected_calls: int = 0  # calls answered with an error (4xx/5xx)
    last_rejection: str = ""  # the last such error, for the failure of a run that got no reply
    sampler_error: SamplerError | None = None  # the last call the sampler failed (a 502)
    tool_calls: int = 0
    malformed_calls: int = 0
    parallel_calls: list[int] = field(default_factory=list)
    in_flight: int = 0
    responses: dict[str, list[dict]] = field(default_factory=dict)  # for previous_response_id


def _text(content) -> str | None:
    """OpenAI content (a string or a list of parts) as the plain text templates expect."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise GatewayError(400, f"message content must be a string or a list of parts, got {type(content).__name__}",
                       param="messages")


def template_messages(messages) -> list[dict]:
    """The request's messages in the form the chat template renders (arguments as objects,
    as the built-in tool loop keeps them, so re-rendered history matches generated tokens)."""
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "'messages' must be a non-empty list of chat messages.", param="messages")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise GatewayError(400, f"messages[{index}] must be an object with a string 'role'.",
                               param=f"messages[{index}]")
        content = _text(message.get("content"))
        if content is None and message.get("role") == "assistant":
            content = ""  # as the tool loop keeps a turn that only calls tools
        converted = {**message, "content": content}
        if message.get("role") == "developer":
            converted["role"] = "system"
        if message.get("tool_calls"):
            converted["tool_calls"] = _template_calls(message["tool_calls"], f"messages[{index}].tool_calls")
        out.append(converted)
    return out


def _template_calls(calls, param: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked here so a malformed one is the agent's 400
    naming it, not a 500 from deep in the handler (which SDK clients also retry)."""
    if not isinstance(calls, list):
        raise GatewayError(400, f"{param} must be a list of tool calls, got {type(calls).__name__}.",
                           param=param)
    for number, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise GatewayError(400, f"{param}[{number}] must be an object with a 'function' object "
                               '({"name": ..., "arguments": "<JSON text>"}), got '
                               f"{json.dumps(call)[:200]}.", param=f"{param}[{number}]")
    return [_template_call(call) for call in calls]


def _template_call(call: dict) -> dict:
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # rendered verbatim: the model wrote it so
    return {"type": "function", "function": function}


def chat_tools(tools) -> list[dict] | None:
    """A chat request's `tools`, checked here so a malformed tool is the agent's 400 naming it;
    the chat template would render it silently into every prompt."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise GatewayError(400, "'tools' must be a list of function tools.", param="tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise GatewayError(400, f"tools[{index}].function must be an object "
                               '({"name": ..., "description": ..., "parameters": {...}}); '
                               f"tools[{index}] is {json.dumps(tool)[:200]}.", param=f"tools[{index}].function")
        check_tool_name(function.get("name"), f"tools[{index}].function.name")
    return tools


def _openai_calls(parsed: ParsedTurn) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for call in parsed.calls]


class Gateway:
    """Serves `/v1/chat/completions`, `/v1/responses` and `/v1/models` for one `AsyncRolloutLoop`
    (on loopback TCP, and on a Unix socket that sandboxed command agents reach through a relay)."""

    def __init__(self, loop, limits: HarnessLimits):
        self.loop = loop
        self.limits = limits
        self.sessions: dict[str, AgentSession] = {}
        self.base_url = ""
        self.unix_path: str | None = None  # the same app, for command agents' relays
        self.encoder = PromptEncoder(loop.tokenizer)  # each turn's text encoded once
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Bind and serve; returns the base URL agents use (ending in /v1)."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.limits.host, self.limits.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        self.unix_path = os.path.join(tempfile.mkdtemp(prefix="grpo-gateway-"), "gateway.sock")
        await web.UnixSite(self._runner, self.unix_path).start()
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.unix_path is not None:
            shutil.rmtree(os.path.dirname(self.unix_path), ignore_errors=True)
            self.unix_path = None

    def open_session(self, version: int) -> AgentSession:
        session = AgentSession(version=version)
        self.sessions[session.key] = session
        return session

    def close_session(self, session: AgentSession) -> None:
        """After this, calls with the session's key are refused (401)."""
        self.sessions.pop(session.key, None)

    # ------------------------------------------------------------------ handlers

    def model_names(self) -> set[str]:
        return {self.loop.model_name, getattr(self.loop.server, "model_id", self.loop.model_name)}

    def _session(self, request: web.Request) -> AgentSession:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        session = self.sessions.get(key)
        if session is None:
            raise GatewayError(401, "Unknown or expired API key: each rollout gets its own key in "
                               "OPENAI_API_KEY (or the client the agent is given); use that one.",
                               "authentication_error", "invalid_api_key")
        return session

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except GatewayError as error:
            return error.response()
        data = [{"id": name, "object": "model", "owned_by": "grpo-agent",
                 "max_model_len": self.loop.server.max_model_len} for name in sorted(self.model_names())]
        return web.json_response({"object": "list", "data": data})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._complete)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._respond)

    async def _serve(self, request: web.Request, handler) -> web.StreamResponse:
        """Authenticate, parse the JSON body, run `handler`; any `GatewayError` is its answer."""
        session = None
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise GatewayError(400, f"The request body is not valid JSON: {error}.") from error
            if not isinstance(body, dict):
                raise GatewayError(400, "The request body must be a JSON object.")
            session.in_flight += 1
            try:
                result = await handler(session, body)
            finally:
                session.in_flight -= 1
        except GatewayError as error:
            if session is not None:
                session.rejected_calls += 1
                session.last_rejection = f"{error.status} {error.message}"
            return error.response()
        if body.get("stream"):
            events = (_chat_chunks(result) if result.get("object") == "chat.completion"
                      else responses_api.stream_events(result))
            return await _stream(request, events)
        return web.json_response(result, headers={SAMPLING_HEADER: SAMPLING_NOTE})

    async def _complete(self, session: AgentSession, body: dict) -> dict:
        """`/v1/chat/completions`."""
        model = self._model(body)
        if body.get("n", 1) not in (1, None):
            raise GatewayError(400, "Only n=1 is supported: a rollout is one conversation; run the "
                               "agent several times instead (num_generations).", param="n")
        self._check_budget(session)
        tools = chat_tools(body.get("tools"))
        # the newer name wins, unless sent as null
        param = "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
        max_tokens = self._max_tokens(body.get(param), session.generated_tokens, param)
        stops = stop_strings(body.get("stop"))
        top = logprobs_asked(body)
        message, finish, usage, turn = await self._sample(session, body.get("messages"), tools,
                                                          body.get("tool_choice"), max_tokens, stops)
        logprobs = None if top is None else chat_logprobs(turn, self.loop.tokenizer, top, stops)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                      "total_tokens": sum(usage)},
        }

    async def _respond(self, session: AgentSession, body: dict) -> dict:
        """`/v1/responses`: the request as chat messages, sampled as a chat call."""
        model = self._model(body)
        self._check_budget(session)
        messages, conversation, tools = responses_api.chat_request(body, session.responses)
        max_tokens = self._max_tokens(body.get("max_output_tokens"), session.generated_tokens,
                                      "max_output_tokens")
        tool_choice = body.get("tool_choice")
        message, finish, usage, _ = await self._sample(session, messages, tools, tool_choice, max_tokens)
        response_id, response = responses_api.response_body(model, message, finish, usage,
                                                            body.get("tools"), tool_choice)
        session.responses[response_id] = [*conversation, message]
        return response

    def _model(self, body: dict) -> str:
        model = body.get("model")
        if model not in self.model_names():
            raise GatewayError(404, f"The model {model!r} does not exist here; this gateway serves "
                               f"{sorted(self.model_names())} (GET /v1/models).",
                               code="model_not_found", param="model")
        return model

    async def _sample(self, session: AgentSession, raw_messages, tools: list | None, tool_choice,
                      max_tokens: int, stops: list[str] = ()) -> tuple[dict, str, tuple[int, int], TurnRecord]:
        """Render, sample token-in/token-out, record the turn, parse tool calls: the reply as
        an OpenAI assistant message, its finish reason, (prompt, completion) token counts and
        the recorded turn. `stops`: the request's stop strings (`cut_at_stop`)."""
        messages = template_messages(raw_messages)
        try:  # one hop off the event loop (each hop costs a thread handoff under the GIL)
            renderer, prompt_text, prompt_ids = await asyncio.get_running_loop().run_in_executor(
                self.loop.tool_executor, self._render, session, tools, messages)
        except Exception as error:  # the template refused these messages
            raise GatewayError(400, f"The chat template could not render these messages: {error_text(error)}",
                               param="messages") from error
        room = self.loop.server.max_model_len - len(prompt_ids)
        if room < 1:
            raise GatewayError(400, f"The prompt is {len(prompt_ids)} tokens; the model's context is "
                               f"{self.loop.server.max_model_len}. Shorten the conversation.",
                               code="context_length_exceeded", param="messages")
        from grpo_agent.rollout.versions import pin_rollout_version

        pin_rollout_version(session.version)  # this handler task's own context
        try:
            turn = await self.loop.generate_one_turn(prompt_ids, max_tokens=min(max_tokens, room))
        except SamplerError as error:  # the run checks it for a lost server once it ends
            session.sampler_error = error
            raise GatewayError(502, f"The sampler failed: {error}", "server_error") from error
        tokenizer = self.loop.tokenizer
        generated = len(turn.output_ids)  # tokens cut off after a stop string were generated too
        turn, reply, text = cut_at_stop(turn, tokenizer, stops)
        self._record(session, messages, turn, generated)
        session.sampled.record(prompt_text, turn, reply)
        parse = tools is not None and tool_choice != "none"
        parsed = renderer.parser.parse(text) if parse else ParsedTurn(text)
        malformed = sum(isinstance(call, MalformedCall) for call in parsed.calls)
        if parsed.calls and turn.finish_reason != "length":  # counted as the tool loop counts:
            session.tool_calls += len(parsed.calls)  # every call written, readable or not,
            session.parallel_calls.append(len(parsed.calls))  # in a turn not cut off
            session.malformed_calls += malformed
        if malformed:
            parsed = ParsedTurn(text)  # the raw text stays visible, as in the tool loop
        message = {"role": "assistant", "content": parsed.content or None}
        finish = "length" if turn.finish_reason == "length" else "stop"
        if parsed.calls:
            message["tool_calls"] = _openai_calls(parsed)
            finish = "tool_calls" if finish == "stop" else finish
        session.last_messages = [*raw_messages, message]
        return message, finish, (len(prompt_ids), len(turn.output_ids)), turn

    def _render(self, session: AgentSession, tools: list | None,
                messages: list[dict]) -> tuple[ConversationRenderer, str, list[int]]:
        renderer = ConversationRenderer(self.loop.tokenizer, tools, _template_kwargs(self.loop.config),
                                        rerenders=True)
        return renderer, *renderer.prompt(messages, session.sampled, self.encoder.encode)

    def _check_budget(self, session: AgentSession) -> None:
        limits = self.limits
        if limits.max_calls is not None and len(session.turns) >= limits.max_calls:
            raise GatewayError(429, f"This rollout made its {limits.max_calls} model calls "
                               "(max calls per rollout); finish the episode.", "rate_limit_error",
                               "rollout_call_budget")
        if limits.max_generated_tokens is not None and session.generated_tokens >= limits.max_generated_tokens:
            raise GatewayError(429, f"This rollout generated its {limits.max_generated_tokens} tokens "
                               "(token budget per rollout); finish the episode.", "rate_limit_error",
                               "rollout_token_budget")
        if time.monotonic() - session.started > limits.timeout_s:
            raise GatewayError(429, f"This rollout ran past its {limits.timeout_s:g} s; finish the "
                               "episode.", "rate_limit_error", "rollout_time_budget")

    def _max_tokens(self, asked, spent: int = 0, param: str = "max_tokens") -> int:
        """The call's token cap: what it asked (null: not asked), `max_completion_length`, and
        what is left of the rollout's token budget after the `spent` tokens, so a call that
        asks for nothing cannot overshoot `agent_max_tokens` by a whole completion."""
        cap = self.loop.config.max_completion_length
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise GatewayError(400, f"{param} must be a positive integer, got {asked!r}.", param=param)
        budget = self.limits.max_generated_tokens
        left = cap if budget is None else max(1, budget - spent)  # _check_budget refused 0 left
        return min(cap, left, cap if asked is None else asked)

    @staticmethod
    def _record(session: AgentSession, messages: list[dict], turn: TurnRecord, generated: int) -> None:
        if session.first_messages is None:
            session.first_messages = messages
        session.turns.append(turn)
        session.generated_tokens += generated


def stop_strings(stop) -> list[str]:
    """A chat request's `stop` (null, a string or a list of strings) as a list, checked here so
    a bad one is the agent's 400 naming it."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise GatewayError(400, f"stop must be a non-empty string or a list of them, got "
                           f"{json.dumps(stop)[:200]}.", param="stop")
    return stops


def _decoded(tokenizer, ids: list[int]) -> str:
    return _strip_stop_tokens(tokenizer.decode(ids, skip_special_tokens=False), tokenizer)


def _fewest_tokens(tokenizer, ids: list[int], holds) -> int:
    """The fewest leading tokens of `ids` whose text `holds` (true of all of them; the decoded
    text only grows with the prefix, so bisecting needs about log2(len(ids)) decodes)."""
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(_decoded(tokenizer, ids[:middle])) else (middle + 1, high)
    return low


def cut_at_stop(turn: TurnRecord, tokenizer, stops) -> tuple[TurnRecord, str, str]:
    """The turn, its output ids decoded with their special tokens (`SampledTurns.record`'s
    reply) and the text the agent gets, applying the request's stop strings as the OpenAI
    API does: the text ends before the first stop string, with finish reason `stop`.

    The sampler knows no stop strings (token in, token out), so the turn is sampled whole and
    cut afterwards: the recorded turn keeps the fewest tokens whose text holds the stop string
    (the policy wrote it, so it is trained) and drops the rest, which the agent never saw.
    Ignoring `stop` instead would hand a ReAct-style agent the observation the model invented
    after "Observation:", and train it."""
    reply = tokenizer.decode(turn.output_ids, skip_special_tokens=False)
    text = _strip_stop_tokens(reply, tokenizer)
    if not any(stop in text for stop in stops):
        return turn, reply, text

    low = _fewest_tokens(tokenizer, turn.output_ids, lambda prefix: any(stop in prefix for stop in stops))
    reply = tokenizer.decode(turn.output_ids[:low], skip_special_tokens=False)
    text = _strip_stop_tokens(reply, tokenizer)
    text = text[:min(text.index(stop) for stop in stops if stop in text)]

    def cut(values):
        return None if values is None else list(values[:low])

    return replace(turn, output_ids=cut(turn.output_ids), output_log_probs=cut(turn.output_log_probs),
                   output_mask=cut(turn.output_mask), output_sampling_mask=cut(turn.output_sampling_mask),
                   output_sampler_logprobs=cut(turn.output_sampler_logprobs),
                   weight_versions=cut(turn.weight_versions), finish_reason="stop"), reply, text


def logprobs_asked(body: dict) -> int | None:
    """The request's `logprobs`/`top_logprobs`, checked as the OpenAI API checks them: None when
    not asked, else the number of alternatives wanted per token."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked not in (None, True, False):
        raise GatewayError(400, f"logprobs must be true or false, got {json.dumps(asked)[:100]}.",
                           param="logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise GatewayError(400, f"top_logprobs must be an integer from 0 to 20, got "
                           f"{json.dumps(top)[:100]}.", param="top_logprobs")
    if top and not asked:
        raise GatewayError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    return (top or 0) if asked else None


def chat_logprobs(turn: TurnRecord, tokenizer, top: int, stops=()) -> dict:
    """OpenAI `logprobs` for the reply's text (tool-call blocks as written, before parsing) from
    the recorded `turn` (`stops`: the request's): each token's log-prob as the sampler returned
    it (the one training uses: vLLM's processed log-probs, after the config's temperature) and,
    as `top_logprobs`, at most `top` of the candidates the sampler recorded for it
    (`num_sampler_logprobs`, with `score_centering`; else none). The end-of-turn token and a
    stop string are not text the agent got, so they are not listed."""
    ids, text = turn.output_ids, cut_at_stop(turn, tokenizer, stops)[2]
    shown = _fewest_tokens(tokenizer, ids, lambda prefix: len(prefix) >= len(text)) if text else 0
    ranked = turn.output_sampler_logprobs or [{}] * shown

    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": float(logprob), "bytes": list(token.encode())}

    return {"content": [{**entry(ids[i], turn.output_log_probs[i]), "top_logprobs": [
        entry(t, v) for t, v in sorted(ranked[i].items(), key=lambda kv: -kv[1])[:top]]}
        for i in range(shown)], "refusal": None}


def _template_kwargs(config) -> dict:
    kwargs = getattr(config, "chat_template_kwargs", None) or {}
    return json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs)


def _chat_chunks(result: dict) -> list[dict]:
    """The finished turn as Chat Completions chunks: role+content (with the logprobs, if asked),
    tool calls, finish."""
    choice = result["choices"][0]
    base = {"id": result["id"], "object": "chat.completion.chunk", "created": result["created"],
            "model": result["model"]}
    deltas = [{"role": "assistant", "content": choice["message"]["content"] or ""}]
    for index, call in enumerate(choice["message"].get("tool_calls") or []):
        deltas.append({"tool_calls": [{"index": index, **call}]})
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None,
                                    "logprobs": choice["logprobs"] if i == 0 else None}]}
              for i, d in enumerate(deltas)]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                   "usage": result["usage"]})
    return chunks


async def _stream(request: web.Request, events: list[dict]) -> web.StreamResponse:
    """Server-sent events: chat chunks end with `[DONE]`; Responses events are named by an
    `event:` line and end with their last event, as the OpenAI API sends them."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", SAMPLING_HEADER: SAMPLING_NOTE})
    await response.prepare(request)
    chat = events[0].get("object") == "chat.completion.chunk"
    payload = "".join(f"data: {json.dumps(e)}\n\n" if chat else
                      f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
    await response.write((payload + ("data: [DONE]\n\n" if chat else "")).encode())
    await response.write_eof()
    return response
