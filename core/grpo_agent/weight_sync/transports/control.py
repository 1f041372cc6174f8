"""What every transport shares: the server's control routes and the end of a push.

`ServerControl` is the one client for control calls (weight routes, version, prefix cache,
LoRA adapters); generation goes through the async `SamplerClient`.

Every push ends by setting the server's weight version and dropping the prefix cache
(`finish_push`), since cached KV from the old weights would otherwise keep producing
old-weight logprobs.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import torch
from typing_extensions import Self

from grpo_agent import stall
from grpo_agent.sampler.client import CONTROL_TIMEOUT_S
from grpo_agent.sampler.errors import (
    RETRYABLE_STATUS,
    RequestRejectedError,
    ServerUnreachableError,
    WeightSyncError,
    exhausted_error,
    rejected_error,
    retry_delay_s,
    server_message,
)
from grpo_agent.sampler.server_facts import weight_version_label

logger = logging.getLogger(__name__)


@dataclass
class SyncTimings:
    """Where a push spent its time; `num_bytes` is what crossed the wire (or hit the disk).

    `pause_s` is how long generation was paused for the push: 0 for our backends, which load
    atomically while requests keep running. `total_s` includes the version update and the
    prefix-cache reset.
    """

    pause_s: float
    transfer_s: float
    total_s: float
    num_bytes: int


class WeightSync(Protocol):
    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTimings: ...

    def close(self) -> None: ...


# vLLM registers its control routes (/server_info, weights, version, prefix cache,
# /collective_rpc) only under this variable; without it they answer a bare 404.
DEV_MODE_ADVICE = ("vLLM serves its control and weight-update routes only when started with "
                   "VLLM_SERVER_DEV_MODE=1 (docs/vllm.md, Server flags)")


def _missing_route_advice(response: httpx.Response) -> str:
    """A bare 404 is a route vLLM did not register: name the variable that registers them."""
    if response.status_code != 404 or server_message(response) != "Not Found":
        return ""
    return f". The server has no such route: {DEV_MODE_ADVICE}"


class ServerControl:
    """Blocking HTTP calls to the server's control routes, each with a timeout.

    Weight routes fail at once (a push is retried as a whole, if at all); the LoRA adapter
    calls retry connection errors, timeouts and 5xx twice, as loads race the server's work.
    """

    LORA_RETRIES = 2

    def __init__(self, base_url: str, timeout: float):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def call(self, method: str, path: str, *, json_body: Any = None,
             params: dict | None = None, timeout: float | None = None) -> Any:
        """`timeout` overrides the client's for this call."""
        extra = {} if timeout is None else {"timeout": timeout}
        try:
            response = self._http.request(method, path, json=json_body, params=params, **extra)
        except httpx.ConnectError as error:
            raise ServerUnreachableError(
                f"No vLLM server answered at {self.base_url} ({error}); is it running?"
            ) from error
        if response.status_code >= 400:
            raise RequestRejectedError(
                f"{method} {self.base_url}{path} failed with HTTP {response.status_code}: "
                f"{response.text.strip()[:2000]}{_missing_route_advice(response)}",
                status_code=response.status_code,
            )
        return response.json() if response.content else None

    def call_retried(self, method: str, path: str, *, retries: int,
                     json_body: Any = None, timeout: float | None = None) -> httpx.Response:
        """`call` with up to `retries` retries of connection errors, timeouts and 5xx; a 4xx
        fails at once with the server's message. Returns the response: the LoRA routes answer
        in plain text."""
        extra = {} if timeout is None else {"timeout": timeout}
        last_problem = ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(retry_delay_s(attempt))
            try:
                response = self._http.request(method, path, json=json_body, **extra)
            except httpx.TransportError as error:
                last_problem = f"{type(error).__name__}: {error or 'connection failed'}"
                continue
            if response.status_code in RETRYABLE_STATUS:
                last_problem = f"HTTP {response.status_code}: {server_message(response)}"
                continue
            if response.status_code >= 400:
                raise rejected_error(method, f"{self.base_url}{path}", response)
            return response
        raise exhausted_error(method, self.base_url, path, last_problem, retries + 1)

    def served_models(self) -> list[str]:
        """Every model id the server answers to: the base model, then loaded LoRA adapters."""
        response = self.call_retried("GET", "/v1/models", retries=self.LORA_RETRIES,
                                     timeout=CONTROL_TIMEOUT_S)
        return [entry["id"] for entry in response.json()["data"]]

    def load_lora_adapter(self, name: str, path: str, *, in_place: bool = False) -> None:
        """Serve the PEFT adapter saved in `path` as model `name` (needs `--enable-lora` and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; the folder must be readable by the server).
        `in_place`: replace the weights of a `name` it holds (vLLM refuses that name else)."""
        body = {"lora_name": name, "lora_path": str(path)}
        if in_place:
            body["load_inplace"] = True
        self.call_retried("POST", "/v1/load_lora_adapter", retries=self.LORA_RETRIES,
                          json_body=body)

    def unload_lora_adapter(self, name: str) -> None:
        self.call_retried("POST", "/v1/unload_lora_adapter", retries=self.LORA_RETRIES,
                          json_body={"lora_name": name})

    def server_info(self) -> dict:
        return self.call("GET", "/server_info", params={"config_format": "json"})

    def set_version(self, version: int) -> None:
        self.call("POST", "/update_weight_version",
                  json_body={"new_version": weight_version_label(version)})

    def reset_prefix_cache(self) -> None:
        """Drop stale KV, preempting running requests so they recompute with the new weights.

        One call: a plain reset fails whenever requests hold blocks (always, mid-run), and then
        this was asked again; trying it first cost a round trip per push (16-22 ms on the busy
        CPU server of issue 21, a tenth of the push)."""
        result = self.call("POST", "/reset_prefix_cache",
                           params={"reset_running_requests": "true"})
        if not result.get("success"):
            raise WeightSyncError(
                f"{self.base_url} refused to reset its prefix cache after a weight push; "
                f"cached KV from the old weights may still be served."
            )

    def worker_count(self) -> int:
        return int(self.call("GET", "/get_world_size", params={"include_dp": "true"})
                   ["world_size"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def start_update(control: ServerControl) -> None:
    """Open a weight update; one left open by a trainer killed mid-push is closed first (the
    push that follows rewrites every weight, so its half-written state does not matter)."""
    try:
        with stall.stage("weight_sync/pause", server=control.base_url):
            control.call("POST", "/start_weight_update")
    except RequestRejectedError as error:
        if "already active" not in str(error):
            raise
        logger.warning("%s had a weight update left open (an earlier trainer stopped "
                       "mid-push); closing it before this push.", control.base_url)
        for path in ("/finish_weight_update", "/start_weight_update"):
            try:
                control.call("POST", path)
            except httpx.TransportError:  # the server drops a connection after a 500: retry once
                control.call("POST", path)


def finish_push(control: ServerControl, version: int, *, version_set: bool = False) -> None:
    """`version_set`: the transport already set the version (gloo sends it with
    `/finish_weight_update`, one HTTP round trip fewer per push)."""
    if not version_set:
        with stall.stage("weight_sync/resume", server=control.base_url, version=version):
            control.set_version(version)
    with stall.stage("weight_sync/cache_reset", server=control.base_url, version=version):
        control.reset_prefix_cache()
