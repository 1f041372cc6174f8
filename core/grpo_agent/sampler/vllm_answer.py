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

`install()` runs through the general plugin in every vLLM process and patches only the API
server's (vLLM's main process or its `ApiServer_<i>` processes), only where vLLM's code has the
shape this was written against (otherwise a warning, and vLLM stays as it is); its answers then
carry `x-grpo-agent-answer: msgspec`. `GRPO_AGENT_VLLM_FAST_ANSWER=0` leaves vLLM as it is.
"""
from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("vllm.grpo_agent")  # at plugin load a warning still reaches stderr

FAST_ANSWER_ENV = "GRPO_AGENT_VLLM_FAST_ANSWER"
# On every answer of a patched route: the one sign of the patch a client can see (at plugin
# load vLLM's logging is not set up yet, so an info line there is lost).
ANSWER_HEADER = "x-grpo-agent-answer"
LOGPROB_FLOOR = -9999.0  # vLLM's log-prob for a sampled token with no entry
_PARAMETERS = ("self", "token_ids", "top_logprobs", "num_output_top_logprobs")


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """On unless `FAST_ANSWER_ENV` says 0/false/off; another value raises, naming it."""
    text = environ.get(FAST_ANSWER_ENV, "").strip().lower()
    if text in ("", "1", "true", "on"):
        return True
    if text in ("0", "false", "off"):
        return False
    raise ValueError(f"{FAST_ANSWER_ENV}={text!r}: give 1 (default) or 0 to keep vLLM's own "
                     "answer encoding.")


def is_api_server_process() -> bool:
    name = multiprocessing.current_process().name
    return name == "MainProcess" or name.startswith("ApiServer")


def tokens_logprobs(self, token_ids, top_logprobs, num_output_top_logprobs=None):
    """`ServingTokens._create_tokens_logprobs` as vLLM 0.32 defines it (the sampled token's
    log-prob and rank, then up to max(k, 1) candidates in the engine's order; -9999.0 and no
    candidates where the sampled token has no entry), built as dicts and validated once."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs
    from vllm.entrypoints.scale_out.token_in_token_out.serving import _clamp_logprob as clamp

    keep = num_output_top_logprobs
    if keep is not None and keep != -1:
        keep = max(keep, 1)
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


def msgspec_json_response(base: type) -> type:
    """A `base` (starlette's JSONResponse) whose body msgspec encodes."""
    import msgspec

    class MsgspecJSONResponse(base):
        def __init__(self, content: Any, status_code: int = 200, headers=None, *args, **kwargs):
            super().__init__(content, status_code, {**(headers or {}), ANSWER_HEADER: "msgspec"},
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
    route = inspect.unwrap(getattr(api_router, "generate", None) or (lambda: None))
    if (original is None or tuple(inspect.signature(original).parameters) != _PARAMETERS
            or not callable(getattr(serving, "_clamp_logprob", None))
            or "JSONResponse" not in route.__code__.co_names
            or not isinstance(getattr(api_router, "JSONResponse", None), type)):
        logger.warning("grpo-agent: this vLLM's generate route is not the shape %s was written "
                       "for; its answers keep vLLM's own encoding.", __name__)
        return False
    serving.ServingTokens._create_tokens_logprobs = tokens_logprobs
    api_router.JSONResponse = msgspec_json_response(api_router.JSONResponse)
    return True
