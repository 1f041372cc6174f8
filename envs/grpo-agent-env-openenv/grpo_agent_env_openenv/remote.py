"""An OpenEnv environment behind a URL: one server session per episode.

Design decision: each episode opens its own WebSocket session with openenv-core's
`GenericEnvClient` (the server builds a fresh env instance per session, so episodes never share
state) and closes it when the episode is scored, so a pooled env instance holds no server slot
between rollouts. The rollout worker calls env methods from its thread pool, so every session of
a process runs on one background event loop thread (not a thread per client). Failures are
sorted by who can act on them: a server that cannot be reached, is full or drops the session
raises `OpenEnvServerError` naming the URL and the fix (it costs the episode's group); an action
the env refuses raises `ValueError` with the server's words, which the model reads as the tool's
answer while the session goes on.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit, urlunsplit

SERVE_HINT = "python -m grpo_agent_env_openenv.serve --port PORT"
_loop_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # (pid, loop): a fork starts its own


class OpenEnvServerError(RuntimeError):
    """The server is unreachable, has no free session, or lost the session mid-episode."""


def _session_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="openenv-sessions", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


def _run(coro) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, _session_loop()).result()


def http_url(url: str) -> str:
    """The server's HTTP base URL (`ws://` and `wss://` become `http://` and `https://`)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"openenv option url={url!r} must be an http(s):// or ws(s):// URL of an "
                         f"OpenEnv server, for example http://127.0.0.1:8000 (started with {SERVE_HINT}).")
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _client_class():
    from openenv.core.generic_client import GenericEnvClient
    from websockets.exceptions import ConnectionClosed

    class SessionClient(GenericEnvClient):
        """GenericEnvClient whose errors keep the server's whole answer: a server at capacity
        says why and closes at once (the answer is read from the closed socket's buffer), and
        a refused action names its fields."""

        async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
            try:
                await self._send(message)
                response = await self._receive()
            except ConnectionClosed as closed:
                try:
                    response = json.loads(await self._ws.recv())
                except (ConnectionClosed, ValueError):  # nothing (readable) was left: just closed
                    raise closed from None
                if response.get("type") != "error":
                    raise
            if response.get("type") == "error":
                raise _ServerAnswer(response.get("data") or {})
            return response

    return SessionClient


class _ServerAnswer(Exception):
    """The server answered a message with an error (`data`: its message, code and details)."""

    def __init__(self, data: dict[str, Any]):
        super().__init__(data.get("message", "error"))
        self.data = data


class RemoteEnv:
    """The OpenEnv server at `url`, seen through the same calls as an env run in process."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        self.base = http_url(url)
        self.url, self.timeout_s = url, timeout_s
        self.client = None
        self._tools: list[dict] | None = None
        self._listed = False

    # ------------------------------------------------------------ plain HTTP endpoints

    def _get(self, path: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=self.timeout_s) as answer:
                return json.loads(answer.read())
        except (urllib.error.URLError, OSError) as error:
            raise self._unreachable(error) from error

    def name(self) -> str:
        """The env's name from the server's `/metadata` (its class name by default)."""
        return str(self._get("/metadata").get("name", ""))

    def action_schema(self) -> dict[str, Any]:
        return self._get("/schema")["action"]

    # ------------------------------------------------------------ the episode's session

    def reset(self, seed: int) -> dict[str, Any]:
        """Close the last episode's session, open a fresh one and reset it with `seed`."""
        self.end()
        self.client = _client_class()(self.base, connect_timeout_s=self.timeout_s,
                                      message_timeout_s=self.timeout_s)
        try:
            _run(self.client.connect())
        except ConnectionError as error:
            self.client = None
            raise self._unreachable(error) from error
        return self._send({"type": "reset", "data": {"seed": seed}})["data"]

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return self._send({"type": "step", "data": action})["data"]

    def tools(self) -> list[dict] | None:
        """The env's MCP tools (name, description, input schema); None for a typed-action env.
        Asked once per instance, through the open session's MCP `tools/list` (not a step)."""
        if not self._listed:
            request = {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}
            answer = self._send({"type": "mcp", "data": request})["data"]
            if answer.get("error"):
                self._tools = None  # "Environment does not support MCP"
            else:
                self._tools = [{key: tool.get(key) for key in ("name", "description", "input_schema")}
                               for tool in answer["result"]["tools"]]
            self._listed = True
        return self._tools

    def end(self) -> None:
        """Close the episode's session (its server slot is free again)."""
        client, self.client = self.client, None
        if client is not None:
            try:
                _run(client.close())
            except Exception:  # noqa: BLE001, S110  (a server already gone has nothing to close)
                pass

    def __del__(self) -> None:
        """An instance dropped mid-episode (a cancelled rollout, `env check`'s throwaway
        instances) gives its server slot back: the close is queued, not awaited."""
        client = getattr(self, "client", None)
        if client is not None and _loop is not None and _loop[0] == os.getpid():
            asyncio.run_coroutine_threadsafe(client.close(), _loop[1])

    def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        if self.client is None:
            raise OpenEnvServerError(f"no open session with the OpenEnv server at {self.url}: "
                                     "reset() opens one per episode.")
        try:
            return _run(self.client._send_and_receive(message))
        except _ServerAnswer as answer:
            raise self._explain(answer.data) from None
        except (ConnectionClosed, OSError, TimeoutError) as error:
            self.end()
            raise OpenEnvServerError(
                f"the OpenEnv server at {self.url} lost the session mid-episode "
                f"({type(error).__name__}: {error}); the episode cannot go on. Check that the "
                f"server is still running (and answers within timeout_s={self.timeout_s:g} s)."
            ) from error

    def _explain(self, data: dict[str, Any]) -> Exception:
        code, message = data.get("code"), data.get("message", "")
        if code == "CAPACITY_REACHED":
            self.end()
            most = data.get("max_sessions", "?")
            return OpenEnvServerError(
                f"the OpenEnv server at {self.url} has no free session ({message}); each rollout "
                f"in flight holds one. Start the server with more sessions (max_concurrent_envs; "
                f"{SERVE_HINT} --max-sessions N) or set max_concurrent_rollouts to at most {most}.")
        if code in ("FACTORY_ERROR", "SESSION_ERROR"):
            self.end()
            return OpenEnvServerError(f"the OpenEnv server at {self.url} could not start a "
                                      f"session: {message} ({code}).")
        details = data.get("errors")
        return ValueError(f"the environment refused the message: {message}"
                          + (f" {json.dumps(details, default=str)}" if details else ""))

    def _unreachable(self, error: BaseException) -> OpenEnvServerError:
        return OpenEnvServerError(
            f"cannot reach the OpenEnv server at {self.url} ({error}). Start it (the shipped "
            f"guess-number env: {SERVE_HINT}; a Docker image or Space of the env serves the same "
            f"API) or fix --env-arg url=.")
