"""E2E helpers: the `grpo-agent` CLI as a subprocess in its own process group, and a private
vLLM server (training pushes weights into it, so it is never the session's shared server)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "grpo_agent.cli.main"]
QUICKSTART_PORT = 8000  # the spec's default vllm_server_base_url


@pytest.fixture(scope="session")
def private_server(tiny_model_path, tmp_path_factory):
    """A vLLM server on the spec's default port, long enough for its default completion length."""
    from grpo_agent.sampler.server import ManagedVLLMServer, find_free_port

    port = QUICKSTART_PORT if _port_free(QUICKSTART_PORT) else find_free_port()
    server = ManagedVLLMServer(
        tiny_model_path, port=port, dtype="float32", max_model_len=4096, enforce_eager=True,
        log_path=tmp_path_factory.mktemp("vllm-e2e") / "server.log",
    )
    with server:
        yield server


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


class Cli:
    """Runs `grpo-agent ...` in a new session, so a test can kill it with its worker and server."""

    def start(self, args: list[str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
        log = open(log_path, "ab")  # noqa: SIM115 - the child holds it; closed when it exits
        return subprocess.Popen(
            [*CLI, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Signal the CLI's process group (the CLI, its rollout worker, its managed server)."""
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        proc.wait(timeout=60)

    def run(self, args: list[str], log_path: Path, timeout: float, cwd: Path | None = None) -> None:
        proc = self.start(args, log_path, cwd)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise AssertionError(
                f"grpo-agent {' '.join(args)} did not finish in {timeout} s:\n" + tail(log_path)
            ) from None
        assert code == 0, f"grpo-agent {' '.join(args)} exited with {code}:\n" + tail(log_path)


@pytest.fixture
def cli() -> Cli:
    return Cli()


def tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def _torchrun(script: Path, *args: str, timeout: float = 600) -> str:
    """Run `script` under torchrun with 2 CPU processes; its stdout (failing with its output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope="session")
def torchrun():
    return _torchrun
