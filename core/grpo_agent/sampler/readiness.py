"""Wait for a vLLM server that is still starting, up to `vllm_server_timeout`.

Why not just retry: `vllm serve` binds its port *before* it loads the model but only listens
once the model is loaded, so for the whole load (minutes for a large model) connections are
refused, exactly as on a port where nothing will ever run. A trainer started next to a loading
server must wait; one pointed at a wrong port should not wait half an hour. The rule:

- the host name does not resolve: fail at once;
- connection refused on an address of this machine: a port that a process holds (we cannot
  bind it ourselves) is a server that is starting, so wait up to the timeout; a port nobody
  holds gets `REFUSED_GRACE_S` (time for a just-launched `vllm serve` to finish its imports
  and bind), then fails;
- connection refused on another machine: its ports cannot be inspected from here, so wait up
  to the timeout (lower `vllm_server_timeout` to fail sooner);
- anything else (connected but no answer yet, timeouts, 5xx from a proxy): the server is up
  or coming up: wait up to the timeout.

Ready means `GET /v1/models` answers below 500 (a 4xx is left to the caller's own request,
which reports it with the server's message).
A log line every `LOG_EVERY_S` says what is awaited and the last error; the first, and one
every `WARN_EVERY_S`, is a warning, because the CLI shows only warnings and a wait of up to
`vllm_server_timeout` must not look like a hang. The port probe binds and closes a socket in
microseconds, once per poll while refused; it never binds a port some process already holds.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable
from urllib.parse import urlparse

import httpx

from grpo_agent.sampler.errors import ServerUnreachableError

logger = logging.getLogger(__name__)

REFUSED_GRACE_S = 60.0
LOG_EVERY_S = 5.0
WARN_EVERY_S = 60.0
URL_SETTING = "--vllm-url (vllm_server_base_url)"
POLL_S = 1.0
_ATTEMPT_TIMEOUT_S = 10.0  # one probe; a loaded server answers /v1/models in milliseconds


async def wait_until_ready(
    base_url: str,
    timeout: float,
    *,
    refused_grace_s: float = REFUSED_GRACE_S,
    log_every_s: float = LOG_EVERY_S,
    start_command: Callable[[int], str] | None = None,
) -> float:
    """Return the seconds waited once the server answers; raise ServerUnreachableError when
    it cannot or did not become ready (see the module docstring for the rule).
    `start_command(port)`: the command that starts the server its caller needs, named where
    nobody holds the port; without it the model, flags and device are unknown here, so the
    error names docs/vllm.md instead of a command (a guessed one would start a wrong server)."""
    base_url = base_url.rstrip("/")
    host, port = _host_port(base_url)
    _resolve_or_fail(base_url, host, port)
    began = last_log = time.monotonic()
    last_warning = -WARN_EVERY_S
    refused_free_since: float | None = None
    attempt = httpx.Timeout(min(timeout, _ATTEMPT_TIMEOUT_S))
    async with httpx.AsyncClient(timeout=attempt) as http:
        while True:
            now = time.monotonic()
            try:
                response = await http.get(f"{base_url}/v1/models")
            except httpx.TransportError as error:
                problem = f"{type(error).__name__}: {error or 'no answer'}"
                if _refused(error):
                    state = port_state(host, port)
                    problem = f"connection refused; {_STATE_TEXT[state].format(port=port)}"
                    if state == "free":
                        refused_free_since = refused_free_since or now
                        if now - refused_free_since >= refused_grace_s:
                            command = start_command(port) if start_command else None
                            how = (f"): `{command}`" if command else
                                   "; the model, the run's settings and the server's device "
                                   "are not known here, so no command)")
                            raise ServerUnreachableError(
                                f"No vLLM server at {base_url}: connections were refused for "
                                f"{now - refused_free_since:.0f} s and no process on this machine "
                                f"holds port {port}. Start one with the flags training needs "
                                f"(docs/vllm.md, Server flags{how}, or pass the right "
                                f"{URL_SETTING}.", start_command=command
                            ) from error
                    else:
                        refused_free_since = None
                else:
                    refused_free_since = None
            else:
                if response.status_code < 500:
                    waited = now - began
                    if waited >= log_every_s:
                        logger.info("vLLM server at %s is ready after %.0f s.", base_url, waited)
                    return waited
                problem = f"HTTP {response.status_code}"
                refused_free_since = None
            now = time.monotonic()
            if now - began >= timeout:
                raise ServerUnreachableError(
                    f"The vLLM server at {base_url} was not ready after {timeout:.0f} s "
                    f"(vllm_server_timeout); last error: {problem}. Check that it is starting "
                    "(its log), or raise vllm_server_timeout for a slow model load."
                )
            if now - last_log >= log_every_s:
                last_log = now
                level = logging.WARNING if now - last_warning >= WARN_EVERY_S else logging.INFO
                last_warning = now if level == logging.WARNING else last_warning
                logger.log(
                    level, "Waiting for the vLLM server at %s to answer GET /v1/models (%.0f s of "
                    "%.0f s): %s", base_url, now - began, timeout, problem,
                )
            await asyncio.sleep(min(POLL_S, max(0.0, timeout - (now - began))))


_STATE_TEXT = {
    "held": "port {port} is held on this machine (a server still loading)",
    "free": "nothing on this machine holds port {port}",
    "remote": "the host is not this machine, so a loading server cannot be told from none",
}


def port_state(host: str, port: int) -> str:
    """'held' (a local process bound it), 'free' (local, unbound) or 'remote'."""
    local = False
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return "remote"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)  # no SO_REUSEADDR: fails on any port a socket holds
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return "held"
                continue  # EADDRNOTAVAIL: not ours; EACCES: a privileged port, cannot tell
            local = True
    return "free" if local else "remote"


def _host_port(base_url: str) -> tuple[str, int]:
    parsed = urlparse(base_url)
    if not parsed.hostname:
        raise ValueError(
            f"vllm_server_base_url={base_url!r} has no host; use e.g. http://localhost:8000"
        )
    return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


def _resolve_or_fail(base_url: str, host: str, port: int) -> None:
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ServerUnreachableError(
            f"The vLLM server host {host!r} of {base_url} does not resolve ({error}); "
            f"fix {URL_SETTING}."
        ) from error



def _refused(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or getattr(seen, "errno", None) == errno.ECONNREFUSED:
            return True
        seen = seen.__cause__ or seen.__context__
    return isinstance(error, httpx.ConnectError) and "refused" in str(error).lower()
