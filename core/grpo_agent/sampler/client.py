"""Async token-in/token-out client for a vLLM server.

Design decision: the rollout worker speaks token ids only, so it trains on exactly what the
server sampled. `generate` uses vLLM's `/inference/v1/generate` (ids in, ids + logprobs +
per-token weight versions out) and falls back to `/v1/completions` with token-id prompts when
the server was started without `--enable-scale-out`. Retries are bounded and limited to what
can succeed (connection errors, timeouts, 5xx); a 4xx fails at once with the server's message,
because retrying a prompt longer than `max_model_len` only stalls the worker. Pooled
connections expire before vLLM's keep-alive timeout (5 s by default) closes them under us.
Generate requests ask for the log-probs as columns (`x-grpo-agent-logprobs: columns`): a server
with our vLLM plugin then skips building an object per top-k candidate (about half of its API
process's CPU with top-8), one without it ignores the header; both answers give the same records.
`GRPO_AGENT_LOGPROB_COLUMNS=0` (or `logprob_columns=False`) stops asking.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import httpx
from typing_extensions import Self

from grpo_agent.sampler.errors import (
    RETRYABLE_STATUS,
    RequestRejectedError,
    SamplerError,
    exhausted_error,
    rejected_error,
    retry_delay_s,
    server_message,
)
from grpo_agent.sampler.generate_wire import Choice, Logprobs, VersionSpan, decode_generate
from grpo_agent.sampler.prometheus import ServerMetrics, parse_server_metrics
from grpo_agent.sampler.vllm_answer import COLUMNS, LOGPROBS_HEADER, env_switch
from grpo_agent.types import TurnRecord

logger = logging.getLogger(__name__)

# Below vLLM's default 5 s keep-alive, so we never reuse a connection the server just closed.
KEEPALIVE_EXPIRY_S = 3.0
CONTROL_TIMEOUT_S = 120.0
GREEDY_TEMPERATURE = 1e-5  # below it vLLM samples greedily (its _SAMPLING_EPS)
LOGPROB_COLUMNS_ENV = "GRPO_AGENT_LOGPROB_COLUMNS"


NO_GENERATE_WARNED_ENV = "GRPO_AGENT_NO_GENERATE_WARNED"


def warn_no_generate_route(base_url: str, environ=os.environ) -> None:
    """Warn that `base_url` lacks the generate route, once per URL for a run's processes.

    Every client of a run finds out on its own (the trainer's start probe, the spawned rollout
    worker, each evaluation), and a second line tells nothing new. The URLs already warned
    about are kept in the environment, so the rollout worker spawned after the probe inherits
    them."""
    warned = environ.get(NO_GENERATE_WARNED_ENV, "").split()
    if base_url in warned:
        return
    environ[NO_GENERATE_WARNED_ENV] = " ".join([*warned, base_url])
    logger.warning(
        "%s has no /inference/v1/generate (start vLLM with --enable-scale-out); "
        "falling back to /v1/completions without per-token weight versions.", base_url)


def logprob_columns_wanted(environ=os.environ) -> bool:
    """Ask the server for log-probs as columns (`vllm_answer`) unless the switch is off."""
    return env_switch(LOGPROB_COLUMNS_ENV, "to take vLLM's own log-prob form", environ)


def adapter_name(lora_name: str | None, version: int) -> str | None:
    """The served LoRA adapter of model version `version` (the name a rollout samples); None means the base model, which
    is version 0 (PEFT initialises LoRA B to zero) and every version without adapter sync."""
    if lora_name is None or version <= 0:
        return None
    return f"{lora_name}-v{version}"


def version_adapters(served: list[str], lora_name: str) -> list[str]:
    """The names among `served` that are `adapter_name`s of `lora_name` (a run's versions)."""
    prefix = f"{lora_name}-v"
    return [name for name in served if name.startswith(prefix) and name[len(prefix):].isdigit()]


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float | None = None
    repetition_penalty: float = 1.0
    num_logprobs: int = 8  # size of the top-k kept per position (0 = sampled token only)
    seed: int | None = None  # never on a CPU server: preempted seeded requests crash it
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # fixed-length outputs (benchmarks, tests)
    return_sampling_mask: bool = False  # keep the server's sampling mask when it sends one


@dataclass
class ModelInfo:
    id: str
    max_model_len: int


class SamplerClient:
    """One pooled HTTP client per process; safe to share between many concurrent tasks."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 1800.0,
        max_retries: int = 5,
        max_connections: int = 512,
        endpoint: str = "auto",
        logprob_columns: bool | None = None,
    ):
        """`endpoint`: "generate" (`/inference/v1/generate`), "completions" (`/v1/completions`)
        or "auto" (generate, switching to completions when the server lacks it).
        `logprob_columns`: ask generate answers for log-probs as columns (None: on unless
        `GRPO_AGENT_LOGPROB_COLUMNS=0`; see the module doc)."""
        if endpoint not in ("auto", "generate", "completions"):
            raise ValueError(
                f"endpoint must be 'auto', 'generate' or 'completions', not {endpoint!r}"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_count = 0
        self._model_info: ModelInfo | None = None
        self._endpoint = self._asked_endpoint = endpoint
        self.logprob_columns = (logprob_columns_wanted() if logprob_columns is None
                                else logprob_columns)
        self._generate_headers = {LOGPROBS_HEADER: COLUMNS} if self.logprob_columns else None
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, model: str | None = None
    ) -> TurnRecord:
        """Sample one completion for `prompt_ids`; the record holds ids, logprobs and top-k.

        `model` names a loaded LoRA adapter to sample with; default the server's base model.
        """
        return (await self.generate_many(prompt_ids, params, 1, model=model))[0]

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, model: str | None = None
    ) -> list[TurnRecord]:
        """Sample `n` completions of one prompt in one request (vLLM's `n`: the server shares
        the prompt, and one HTTP exchange replaces `n`). Record i is choice i, with its own ids,
        logprobs, top-k, finish reason and weight versions, as `n` calls of `generate` give.
        Greedy sampling (temperature 0) goes out as `n` requests: vLLM refuses `n > 1` for it
        (HTTP 400 "n must be 1 when using greedy sampling")."""
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one completion")
        if n > 1 and params.temperature < GREEDY_TEMPERATURE:
            return [turns[0] for turns in await asyncio.gather(*(
                self.generate_many(prompt_ids, params, 1, model=model) for _ in range(n)))]
        model = model or (await self.model_info()).id
        if self._endpoint != "completions":
            try:
                return await self._generate_tokens(prompt_ids, params, model, n)
            except RequestRejectedError as error:
                if self._endpoint == "generate" or not _route_missing(error):
                    raise
                if self._endpoint == "auto":  # not again for the requests in flight with it
                    warn_no_generate_route(self.base_url)
                self._endpoint = "completions"
        return await self._generate_completions(prompt_ids, params, model, n)

    async def _generate_tokens(
        self, prompt_ids: list[int], params: SamplingParams, model: str, n: int
    ) -> list[TurnRecord]:
        body = generate_body(model, prompt_ids, params, n)
        response = await self._request("POST", "/inference/v1/generate", json=body,
                                       headers=self._generate_headers)
        url = f"{self.base_url}/inference/v1/generate"
        data = decode_generate(response.content, url)
        choices = sorted(data.choices, key=lambda choice: choice.index)
        _check_choice_count(len(choices), n, self.base_url)
        return [_turn_from_generate(prompt_ids, choice, params, url) for choice in choices]

    async def _generate_completions(
        self, prompt_ids: list[int], params: SamplingParams, model: str, n: int
    ) -> list[TurnRecord]:
        body = {"model": model, "prompt": list(prompt_ids), "return_token_ids": True,
                "return_tokens_as_token_ids": True, **_sampling_body(params, n)}
        data = await self._request_json("POST", "/v1/completions", json=body)
        return [_turn_from_completion(prompt_ids, choice, params)
                for choice in _choices(data, n, self.base_url)]

    # ------------------------------------------------------------------ server state

    async def model_info(self) -> ModelInfo:
        """The served model's id and `max_model_len` (fetched once, then cached)."""
        if self._model_info is None:
            try:
                data = await self._request_json("GET", "/v1/models", timeout=CONTROL_TIMEOUT_S)
            except RequestRejectedError as error:
                if error.status_code != 404:
                    raise
                # e.g. another program holds the port, or an OpenAI-style URL ending in /v1
                hint = (f" It is the server's root, without /v1: {self.base_url.removesuffix('/v1')}."
                        if self.base_url.endswith("/v1") else "")
                raise RequestRejectedError(
                    f"{self.base_url} answers, but not as a vLLM server: GET /v1/models gave "
                    f"HTTP 404. Check the URL (--vllm-url / vllm_server_base_url) and which "
                    f"program listens on that port.{hint}", status_code=404,
                    server_message=error.server_message) from error
            first = data["data"][0]
            self._model_info = ModelInfo(id=first["id"], max_model_len=int(first["max_model_len"]))
        return self._model_info

    async def served_models(self) -> list[str]:
        """Every model id the server answers to now: the base model, then its LoRA adapters
        (not cached: adapters come and go)."""
        data = await self._request_json("GET", "/v1/models", timeout=CONTROL_TIMEOUT_S)
        return [entry["id"] for entry in data["data"]]

    def forget_server(self) -> None:
        """The server was restarted: ask it again for its model and `max_model_len`, and
        try the generate route again (it may serve other flags now)."""
        self._model_info = None
        self._endpoint = self._asked_endpoint

    async def metrics(self) -> ServerMetrics | None:
        """Scheduler gauges from `/metrics`; None when the server does not expose them."""
        text = await self.metrics_text()
        return None if text is None else parse_server_metrics(text)

    async def metrics_text(self) -> str | None:
        """The Prometheus text of `/metrics`; None when the server does not expose it."""
        response = await self._request("GET", "/metrics", timeout=CONTROL_TIMEOUT_S,
                                       allow_status=(404,))
        return None if response.status_code == 404 else response.text

    async def server_info(self) -> dict:
        """The server's resolved configuration (`GET /server_info?config_format=json`)."""
        return await self._request_json("GET", "/server_info", params={"config_format": "json"},
                                        timeout=CONTROL_TIMEOUT_S)

    # ------------------------------------------------------------------ transport

    async def _request_json(self, method: str, path: str, **kwargs) -> Any:
        return (await self._request(method, path, **kwargs)).json()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        allow_status: tuple[int, ...] = (),
    ) -> httpx.Response:
        """Send with bounded retries on connection errors, timeouts and 5xx responses."""
        last_problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retry_count += 1
                await asyncio.sleep(retry_delay_s(attempt))
            try:
                response = await self._http.request(
                    method, path, json=json, params=params, headers=headers,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TransportError as error:
                last_problem = f"{type(error).__name__}: {error or 'connection failed'}"
                continue
            if response.status_code in RETRYABLE_STATUS:
                last_problem = f"HTTP {response.status_code}: {server_message(response)}"
                continue
            if response.status_code >= 400 and response.status_code not in allow_status:
                raise rejected_error(method, f"{self.base_url}{path}", response)
            return response
        raise exhausted_error(method, self.base_url, path, last_problem, self.max_retries + 1)


def _route_missing(error: RequestRejectedError) -> bool:
    """403: scale-out endpoints disabled; a bare 404: no such route (not an unknown model)."""
    return error.status_code == 403 or (
        error.status_code == 404 and error.server_message == "Not Found")


def _choices(data: dict, n: int, base_url: str) -> list[dict]:
    """The response's `n` choices in index order (choice i is the i-th sample)."""
    choices = sorted(data.get("choices") or [], key=lambda choice: choice.get("index", 0))
    _check_choice_count(len(choices), n, base_url)
    return choices


def _check_choice_count(count: int, n: int, base_url: str) -> None:
    if count != n:
        raise SamplerError(f"{base_url} answered {count} choices to a request for n={n}; "
                           "a vLLM server returns one per requested sample (check the server version).")


def generate_body(model: str, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> dict[str, Any]:
    """The `/inference/v1/generate` request. Ids only: with detokenize on, vLLM's API process
    decodes every sampled token and each of its top-k, about half of that process's CPU."""
    return {"model": model, "token_ids": list(prompt_ids),
            "sampling_params": {**_sampling_body(params, n), "detokenize": False}}


def _sampling_body(params: SamplingParams, n: int = 1) -> dict[str, Any]:
    """vLLM sampling fields; asks for k+1 logprobs so a full top-k survives (see module doc)."""
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "repetition_penalty": params.repetition_penalty,
        "logprobs": params.num_logprobs + 1 if params.num_logprobs > 0 else 0,
    }
    if n != 1:
        body["n"] = n
    if params.min_p is not None:
        body["min_p"] = params.min_p
    if params.seed is not None:
        body["seed"] = params.seed
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def _turn_from_generate(prompt_ids: list[int], choice: Choice, params: SamplingParams,
                        url: str = "the server") -> TurnRecord:
    output_ids = choice.token_ids or []
    logprobs = choice.logprobs
    top_k = params.num_logprobs
    if logprobs is not None and logprobs.content is None and logprobs.sampled_logprobs is not None:
        output_log_probs, sampler_logprobs = _from_columns(logprobs, top_k, len(output_ids), url)
    else:
        content = (logprobs.content if logprobs is not None else None) or []
        output_log_probs = [position.logprob for position in content]
        sampler_logprobs = [
            {c.token_id: c.logprob for c in position.top_logprobs
             if c.rank is not None and c.rank <= top_k}
            for position in content
        ] if top_k > 0 else None
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_log_probs=output_log_probs,
        output_sampler_logprobs=sampler_logprobs,
        output_sampling_mask=choice.sampling_mask if params.return_sampling_mask else None,
        finish_reason=choice.finish_reason,
        weight_versions=_expand_weight_versions(choice.weight_versions, len(output_ids)),
    )


def _from_columns(columns: Logprobs, top_k: int, num_tokens: int, url: str
                  ) -> tuple[list[float], list[dict[int, float]] | None]:
    """The sampled log-probs and top-k maps of a columns answer, as `content` would give them:
    the candidates ranked 1..top_k (a candidate without a rank is left out there too)."""
    lists = (columns.sampled_logprobs, columns.top_ids, columns.top_logprobs, columns.top_ranks)
    lengths = {len(values) if values is not None else None for values in lists}
    if lengths != {num_tokens}:
        raise SamplerError(f"{url} answered log-prob columns of lengths "
                           f"{[None if v is None else len(v) for v in lists]} for {num_tokens} "
                           "tokens; expected one entry per token in each (a grpo-agent vLLM "
                           "plugin of another version?).")
    if top_k <= 0:
        return columns.sampled_logprobs, None
    return columns.sampled_logprobs, [
        {token_id: value for token_id, value, rank in zip(ids, values, ranks)
         if rank is not None and rank <= top_k}
        for ids, values, ranks in zip(columns.top_ids, columns.top_logprobs, columns.top_ranks)]


def _expand_weight_versions(spans: list[VersionSpan] | None, num_tokens: int) -> list[str] | None:
    """Turn vLLM's `[{version, start, end}]` spans into one version string per token."""
    if not spans:
        return None
    versions = [""] * num_tokens
    for span in spans:
        for index in range(span.start, min(span.end, num_tokens)):
            versions[index] = str(span.version)
    return versions


def _turn_from_completion(
    prompt_ids: list[int], choice: dict, params: SamplingParams
) -> TurnRecord:
    logprobs = choice.get("logprobs") or {}
    top_k = params.num_logprobs
    sampler_logprobs = None
    if top_k > 0:
        sampler_logprobs = []
        for position in logprobs.get("top_logprobs") or []:
            ranked = sorted(position.items(), key=lambda item: item[1], reverse=True)[:top_k]
            sampler_logprobs.append({_completion_token_id(k): float(v) for k, v in ranked})
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=[int(t) for t in choice["token_ids"]],
        output_log_probs=[float(v) for v in logprobs.get("token_logprobs") or []],
        output_sampler_logprobs=sampler_logprobs,
        finish_reason=choice.get("finish_reason"),
        weight_versions=None,
    )


def _completion_token_id(token: str) -> int:
    """`/v1/completions` keys logprobs as "token_id:123" with `return_tokens_as_token_ids`."""
    return int(token.rsplit(":", 1)[1])
