"""vLLM's `/inference/v1/generate` answer, decoded straight into typed records.

Design decision: with top-k log-probs every generated token carries k+1 JSON objects, so a
64-token answer with n=8 is ~0.5 MB. `json.loads` builds a dict per object and the client then
walks them again; msgspec (a dependency of vLLM itself) decodes into these structs in one pass,
skipping the fields we never read (the API server's `token`, `bytes`, `stop_reason`, ...):
an n=8 x 64-token top-9 answer goes to records in 1.6 ms instead of 5.9, the rollout worker's
CPU per generated token falls 22% in the pipeline (issue 21, docs/performance.md). The structs mirror vLLM's
`GenerateTokensChoice` (vllm/entrypoints/scale_out/token_in_token_out/protocol.py) with only
the fields the client uses. A server with our vLLM plugin answers in columns when the request
asks (`x-grpo-agent-logprobs: columns`, `sampler/vllm_answer.py`): four lists per choice instead
of ten objects per token, read by the same structs.
"""
from __future__ import annotations

import msgspec

from grpo_agent.sampler.errors import SamplerError


class Candidate(msgspec.Struct):
    """One of a position's top-k: its id, log-prob and rank (None: the sampled token only)."""

    token_id: int
    logprob: float
    rank: int | None = None


class Position(msgspec.Struct):
    """The sampled token's log-prob at one position and its top-k candidates."""

    logprob: float
    top_logprobs: list[Candidate] = []


class Logprobs(msgspec.Struct):
    """vLLM's form (`content`: an object per position and candidate) or, from a server with our
    plugin asked for it, the columns form (`grpo_agent.sampler.vllm_answer`): per position the
    sampled token's log-prob, and the candidates' ids, log-probs and ranks as lists."""

    content: list[Position] | None = None
    sampled_logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    top_ranks: list[list[int | None]] | None = None


class VersionSpan(msgspec.Struct):
    """Output tokens [start, end) were sampled by weights labelled `version`."""

    version: str | int
    start: int
    end: int


class Choice(msgspec.Struct):
    index: int = 0
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: Logprobs | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[VersionSpan] | None = None


class GenerateResponse(msgspec.Struct):
    choices: list[Choice] = []


_DECODER = msgspec.json.Decoder(GenerateResponse)


def decode_generate(body: bytes, url: str) -> GenerateResponse:
    """The typed answer; a body of another shape fails naming the URL and the mismatch."""
    try:
        return _DECODER.decode(body)
    except msgspec.DecodeError as error:  # ValidationError is a subclass
        raise SamplerError(
            f"{url} answered with a body that is not vLLM's /inference/v1/generate response "
            f"({error}; starts {body[:200]!r}). Point vllm_server_base_url at a vLLM >= 0.32 "
            "server started with --enable-scale-out."
        ) from error
