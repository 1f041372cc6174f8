"""What every transport shares: the server's control routes and the end of a push.

Every push ends by setting the server's weight version and dropping the prefix cache
(`finish_push`), since cached KV from the old weights would otherwise keep producing
old-weight logprobs.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import torch

from grpo_agent import stall
from grpo_agent.sampler.errors import (
    RequestRejectedError,
    ServerUnreachableError,
    WeightSyncError,
)

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


class ServerControl:
    """Blocking HTTP calls to the server's weight and cache routes, each with a timeout."""

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
                f"{response.text.strip()[:2000]}",
                status_code=response.status_code,
            )
        return response.json() if response.content else None

    def server_info(self) -> dict:
        return self.call("GET", "/server_info", params={"config_format": "json"})

    def set_version(self, version: int) -> None:
        self.call("POST", "/update_weight_version", json_body={"new_version": str(version)})

    def reset_prefix_cache(self) -> None:
        """Drop stale KV; if running requests hold blocks, preempt them so they recompute."""
        if self.call("POST", "/reset_prefix_cache").get("success"):
            return
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


def finish_push(control: ServerControl, version: int) -> None:
    with stall.stage("weight_sync/resume", server=control.base_url, version=version):
        control.set_version(version)
    with stall.stage("weight_sync/cache_reset", server=control.base_url, version=version):
        control.reset_prefix_cache()
