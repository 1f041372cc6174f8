"""Serve an OpenEnv environment class over HTTP/WebSocket with openenv-core's own server.

`python -m grpo_agent_env_openenv.serve --port 8000` serves the shipped guess-number env;
`--env module:Class` serves any importable OpenEnv `Environment`. The app is openenv-core's
`create_app` (the one `openenv init`'s template builds), so a client sees exactly what a
Docker image or Hugging Face Space of that env would answer; `--env-arg url=` connects to it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

from grpo_agent_env_openenv import DEFAULT_ENV, action_class, environment_class


def create_env_app(env: str = DEFAULT_ENV, action: str = "", max_sessions: int = 64):
    """openenv-core's FastAPI app for the env class, `max_sessions` WebSocket sessions at once."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation

    env_cls = environment_class(env)
    if issubclass(env_cls, MCPEnvironment) and not action:
        action_cls, observation_cls = CallToolAction, CallToolObservation
    else:
        action_cls = action_class(env_cls, action)
        observation_cls = Observation
    return create_app(env_cls, action_cls, observation_cls, max_concurrent_envs=max_sessions)


@contextlib.contextmanager
def serving(env: str = DEFAULT_ENV, max_sessions: int = 64, port: int = 0,
            ready_timeout_s: float = 120.0) -> Iterator[subprocess.Popen]:
    """This module's server in a subprocess on a free local port until the block ends; yields
    the process, its URL in `.url`. For tests and scripts that need a server of their own."""
    port = port or _free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115  (closed below; a file, not a pipe, so a
    # chatty server never blocks on a full one)
    process = subprocess.Popen(
        [sys.executable, "-m", "grpo_agent_env_openenv.serve", "--env", env, "--port", str(port),
         "--max-sessions", str(max_sessions)], stdout=log, stderr=subprocess.STDOUT)
    process.url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _healthy(process.url):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                log.seek(0)
                output = log.read().decode(errors="replace")
                raise RuntimeError(f"the OpenEnv server for {env} did not come up on port {port} "
                                   f"(exit {process.returncode}):\n{output[-3000:]}")
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        log.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return json.loads(answer.read()).get("status") == "healthy"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default=DEFAULT_ENV, help="OpenEnv Environment class, module:Class")
    parser.add_argument("--action", default="", help="its Action class, module:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=64,
                        help="concurrent WebSocket sessions (one per rollout in flight)")
    args = parser.parse_args(argv)
    app = create_env_app(args.env, args.action, args.max_sessions)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
