"""Inside a vLLM API server: the `/inference/v1/generate` answer's log-probs built and encoded cheaply.

Design decision: score centering asks for the top-8 log-probs of every generated token (the
spec's default, `num_sampler_logprobs=8`), and vLLM 0.32's API process builds each candidate as
its own pydantic model (a Python `__init__` per candidate, ten per token), dumps them back to
dicts and renders those with the `json` module: on one CPU core a top-8 answer cost that process
85 us of CPU per generated token against 39 us for the sampled token alone, and the spec warns
that this work halves generation with one API server on a GPU. Here each choice's log-probs are
built as plain dicts and validated by one pydantic call (the same models, so the same dump), and
the generate route's JSON is encoded by msgspec (a vLLM dependency): 65 us and 32 us per token
(docs/performance.md). The answer's JSON values are the same; only number spelling differs
(`1e-05` vs `0.00001`), which every JSON reader reads alike.

Columns (opt-in per request): even that one validation and its dump were a third of the patched
process's CPU under load (py-spy). A request carrying `x-grpo-agent-logprobs: columns` (our
client sends it) gets each choice's log-probs as plain lists instead of one object per candidate:
`{"sampled_logprobs": [...], "sampled_ranks": [...], "top_ids": [[...]], "top_logprobs": [[...]],
"top_ranks": [[...]]}`, one entry per generated token, the same values vLLM's objects carry
(`-9999.0` and no candidates for a sampled token without an entry, `_clamp_logprob`, the same k),
built without pydantic. vLLM's serving code still builds the answer; each choice gets an empty
`GenerateLogProbs` as a placeholder, and the route's response (the same request's task, so a
context variable carries the columns from one to the other) puts the columns in its place. Only
non-streamed token answers take this path; without the header the answer is as before. Top-8
answers then cost the API server 37 us of CPU per generated token instead of 52 (docs/
performance.md, `bench/server_cost.py`).

`install()` runs through the general plugin in every vLLM process and patches only the API
server's (vLLM's main process or its `ApiServer_<i>` processes), only where vLLM's code has the
shape this was written against (otherwise a warning, and vLLM stays as it is); its answers then
carry `x-grpo-agent-answer: msgspec` (`columns` where the log-probs are columns).
`GRPO_AGENT_VLLM_FAST_ANSWER=0` leaves vLLM as it is.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import multiprocessing
import os
from collections.abc import Mapping
from itertools import islice
from typing import Any

logger = logging.getLogger("vllm.grpo_agent")  # at plugin load a warning still reaches stderr

FAST_ANSWER_ENV = "GRPO_AGENT_VLLM_FAST_ANSWER"
# On every answer of a patched route: the one sign of the patch a client can see (at plugin
# load vLLM's logging is not set up yet, so an info line there is lost).
ANSWER_HEADER = "x-grpo-agent-answer"
# A request header asking for the columns form; a server without the patch ignores it.
LOGPROBS_HEADER = "x-grpo-agent-logprobs"
COLUMNS = "columns"
LOGPROB_FLOOR = -9999.0  # vLLM's log-prob for a sampled token with no entry
_PARAMETERS = ("self", "token_ids", "top_logprobs", "num_output_top_logprobs")
_SERVE_PARAMETERS = ("self", "request", "raw_request")
# The columns of this request's choices, in the order vLLM built them; None: answer as vLLM does.
# Set by the patched `serve_tokens` and taken by the route's response, both in the route's task.
_PENDING_COLUMNS: contextvars.ContextVar[list[dict[str, list]] | None] = contextvars.ContextVar(
    "grpo_agent_logprob_columns", default=None)


def env_switch(name: str, off_means: str, environ: Mapping[str, str] = os.environ) -> bool:
    """An on/off environment switch: on unless it says 0/false/off; another value raises,
    naming the variable and what 0 does (`off_means`)."""
    text = environ.get(name, "").strip().lower()
    if text in ("", "1", "true", "on"):
        return True
    if text in ("0", "false", "off"):
        return False
    raise ValueError(f"{name}={text!r}: give 1 (default) or 0 {off_means}.")


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return env_switch(FAST_ANSWER_ENV, "to keep vLLM's own answer encoding", environ)


def is_api_server_process() -> bool:
    name = multiprocessing.current_process().name
    return name == "MainProcess" or name.startswith("ApiServer")


def _kept(num_output_top_logprobs: int | None) -> int | None:
    """How many of a position's entries vLLM puts in `top_logprobs`: None none, -1 all, else
    max(k, 1) (k=0 still sends the sampled token's own entry)."""
    keep = num_output_top_logprobs
    return keep if keep is None or keep == -1 else max(keep, 1)


def tokens_logprobs(self, token_ids, top_logprobs, num_output_top_logprobs=None):
    """`ServingTokens._create_tokens_logprobs` as vLLM 0.32 defines it (the sampled token's
    log-prob and rank, then up to max(k, 1) candidates in the engine's order; -9999.0 and no
    candidates where the sampled token has no entry), built as dicts and validated once. While
    a columns request is answered, the columns instead, and an empty placeholder for vLLM."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs
    from vllm.entrypoints.scale_out.token_in_token_out.serving import _clamp_logprob as clamp

    pending = _PENDING_COLUMNS.get()
    if pending is not None:
        pending.append(logprob_columns(token_ids, top_logprobs, num_output_top_logprobs, clamp))
        return GenerateLogProbs.model_construct(content=None)  # dumps as {"content": None}
    keep = _kept(num_output_top_logprobs)
    content: list[dict[str, Any]] = []
    for token_id, step in zip(token_ids, top_logprobs):
        sampled = None if step is None else step.get(token_id)
        if sampled is None:
            content.append({"token_id": token_id, "logprob": LOGPROB_FLOOR})
            continue
        top: list[dict[str, Any]] = []
        if keep is not None:
            for candidate_id, candidate in step.items():
                if keep != -1 and len(top) == keep:
                    break
                top.append({"token_id": candidate_id, "logprob": clamp(candidate.logprob),
                            "rank": candidate.rank or None})
        content.append({"token_id": token_id, "logprob": clamp(sampled.logprob),
                        "rank": sampled.rank or None, "top_logprobs": top})
    return GenerateLogProbs.model_validate({"content": content})


def logprob_columns(token_ids, top_logprobs, num_output_top_logprobs, clamp) -> dict[str, list]:
    """One choice's log-probs as columns: per generated token the sampled token's log-prob and
    rank, and the ids, log-probs and ranks of the candidates vLLM's answer lists (the same k, the
    same order, `clamp`ed and as floats as its pydantic fields make them; rank 0 as None)."""
    keep = _kept(num_output_top_logprobs)
    sampled_logprobs: list[float] = []
    sampled_ranks: list[int | None] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    top_ranks: list[list[int | None]] = []
    for token_id, step in zip(token_ids, top_logprobs):
        sampled = None if step is None else step.get(token_id)
        if sampled is None:
            entries: list = []
            sampled_logprobs.append(LOGPROB_FLOOR)
            sampled_ranks.append(None)
        else:
            sampled_logprobs.append(float(clamp(sampled.logprob)))
            sampled_ranks.append(sampled.rank or None)
            if keep is None:
                entries = []
            elif keep == -1:
                entries = list(step.items())
            else:
                entries = list(islice(step.items(), keep))
        top_ids.append([candidate_id for candidate_id, _ in entries])
        top_values.append([float(clamp(candidate.logprob)) for _, candidate in entries])
        top_ranks.append([candidate.rank or None for _, candidate in entries])
    return {"sampled_logprobs": sampled_logprobs, "sampled_ranks": sampled_ranks,
            "top_ids": top_ids, "top_logprobs": top_values, "top_ranks": top_ranks}


def with_columns(content: Any, columns: list[dict[str, list]]) -> bool:
    """Put `columns` (in order) where the route's dumped `content` has the placeholders; returns
    whether it did. A count or length that does not match raises: vLLM built its choices some
    other way than this was written for, and an answer with misplaced values must not go out."""
    choices = content.get("choices") if isinstance(content, dict) else None
    if choices is None:  # an error answer
        return False
    slots = [choice for choice in choices if choice.get("logprobs") == {"content": None}]
    if len(slots) != len(columns) or any(
            len(choice.get("token_ids") or ()) != len(column["sampled_logprobs"])
            for choice, column in zip(slots, columns)):
        raise RuntimeError(
            f"grpo-agent ({__name__}): {len(columns)} log-prob columns for {len(slots)} "
            f"placeholders among {len(choices)} choices (or token counts differ); this vLLM's "
            f"generate route builds its answer differently. Set {FAST_ANSWER_ENV}=0 on the server "
            "or drop the client's logprob columns.")
    for choice, column in zip(slots, columns):
        choice["logprobs"] = column
    return True


def serve_tokens_asking_columns(original):
    """`ServingTokens.serve_tokens` that, for a non-streamed request carrying
    `LOGPROBS_HEADER: columns`, lets this request's choices collect columns."""
    @functools.wraps(original)
    async def serve_tokens(self, request, raw_request=None):
        if (raw_request is not None and not getattr(request, "stream", True)
                and raw_request.headers.get(LOGPROBS_HEADER) == COLUMNS):
            _PENDING_COLUMNS.set([])  # this task's context: the route's response takes it
        return await original(self, request, raw_request)

    serve_tokens.grpo_agent_columns = True
    return serve_tokens


def msgspec_json_response(base: type) -> type:
    """A `base` (starlette's JSONResponse) whose body msgspec encodes, with a pending request's
    columns in place of their placeholders."""
    import msgspec

    class MsgspecJSONResponse(base):
        def __init__(self, content: Any, status_code: int = 200, headers=None, *args, **kwargs):
            form = "msgspec"
            columns = _PENDING_COLUMNS.get()
            if columns is not None:
                _PENDING_COLUMNS.set(None)
                if with_columns(content, columns):
                    form = COLUMNS
            super().__init__(content, status_code, {**(headers or {}), ANSWER_HEADER: form},
                             *args, **kwargs)

        def render(self, content: Any) -> bytes:
            return msgspec.json.encode(content)

    return MsgspecJSONResponse


def install(environ: Mapping[str, str] = os.environ) -> bool:
    """Patch the generate route of this API server process; returns whether it did."""
    if not wanted(environ) or not is_api_server_process():
        return False
    try:
        from vllm.entrypoints.scale_out.token_in_token_out import api_router, serving
    except ImportError:  # a vLLM without the generate route: nothing to patch
        return False
    original = getattr(serving.ServingTokens, "_create_tokens_logprobs", None)
    if original is tokens_logprobs:
        return True  # installed already (vLLM may load its plugins more than once)
    serve = getattr(serving.ServingTokens, "serve_tokens", None)
    route = inspect.unwrap(getattr(api_router, "generate", None) or (lambda: None))
    names = route.__code__.co_names
    if (original is None or tuple(inspect.signature(original).parameters) != _PARAMETERS
            or not inspect.iscoroutinefunction(serve)
            or tuple(inspect.signature(serve).parameters) != _SERVE_PARAMETERS
            or not callable(getattr(serving, "_clamp_logprob", None))
            or not {"JSONResponse", "serve_tokens", "model_dump"} <= set(names)
            or not isinstance(getattr(api_router, "JSONResponse", None), type)):
        logger.warning("grpo-agent: this vLLM's generate route is not the shape %s was written "
                       "for; its answers keep vLLM's own encoding.", __name__)
        return False
    serving.ServingTokens._create_tokens_logprobs = tokens_logprobs
    serving.ServingTokens.serve_tokens = serve_tokens_asking_columns(serve)
    api_router.JSONResponse = msgspec_json_response(api_router.JSONResponse)
    return True
