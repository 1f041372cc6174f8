"""Start and stop a real `vllm serve` process that this Python process owns.

Design decision: tests, benchmarks and the CLI's embedded default all need a real server with
the spec's flags, and must never touch servers they did not start. So the server runs in its
own session (process group) started by us, we remember its PID, and `stop()` signals that
group only. Every failure to come up (bad model path, crash, timeout) raises with the tail of
the server's log, because vLLM explains its own failures there.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import httpx

from grpo_agent.sampler.cpu_cores import lower_priority
from grpo_agent.sampler.errors import ServerStartupError
from grpo_agent.sampler.vllm_entry import OWNER_PID_ENV
from grpo_agent.sampler.vllm_wait import CPU_WAIT_SLEEP_S, WAIT_SLEEP_ENV, sleep_seconds
from grpo_agent.stall import SERVER_STARTUP_TIMEOUT_S

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")
_HEALTH_POLL_S = 0.5
_STOP_GRACE_S = 20.0

# The servers this process started and has not stopped, by base URL: the run's recovery
# (`sampler.recovery`) restarts the one it trains against when it dies.
_RUNNING: weakref.WeakValueDictionary[str, ManagedVLLMServer] = weakref.WeakValueDictionary()


def managed_server_at(base_url: str) -> ManagedVLLMServer | None:
    """The server this process started at `base_url`, if any (None: an external server)."""
    return _RUNNING.get(base_url.rstrip("/"))


# What a server that trainers push weights into needs besides its flags (docs/vllm.md, Server
# flags): set by `ManagedVLLMServer` and named by `serve_command`.
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # pause/resume, collective_rpc, reset_prefix_cache, weight pushes
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600",  # pooled client connections stay usable
}


# What a server needs to load LoRA adapters while it runs, besides `lora_flags`.
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def lora_flags(max_lora_rank: int | None, max_loras: int | None) -> list[str]:
    """The `vllm serve` flags of a server that adapter sync pushes LoRA adapters into."""
    flags = ["--enable-lora"]
    if max_lora_rank is not None:
        flags += ["--max-lora-rank", str(max_lora_rank)]
    if max_loras is not None:
        flags += ["--max-loras", str(max_loras)]
    return flags


def training_flags(max_model_len: int, max_logprobs: int, backend: str | None) -> list[str]:
    """The `vllm serve` flags training needs: the log-prob ones `check_training_server`
    refuses a server without, the generate route that stamps weight versions, and the
    weight-transfer engine (`backend` None or "disk": none, the trainer writes to disk)."""
    flags = ["--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
             "--max-logprobs", str(max_logprobs), "--enable-scale-out"]
    if backend and backend != "disk":
        flags += ["--weight-transfer-config", json.dumps({"backend": backend})]
    return flags


# The managed server's context: at least this, and room for a prompt of PROMPT_ROOM tokens
# beside the run's max_completion_length.
MANAGED_MAX_MODEL_LEN = 1024
PROMPT_ROOM = 512
# The dtype a server started without --vllm-url serves in (`grpo-agent train` and `eval`): the
# trainer's float32 weights, so trainer and sampler log-probs agree.
MANAGED_DTYPE = "float32"


def managed_max_model_len(model_path: str, max_completion_length: int) -> int:
    """The managed server's --max-model-len for the model at `model_path` (`run_max_model_len`)."""
    from transformers import AutoConfig

    return run_max_model_len(max_completion_length, getattr(
        AutoConfig.from_pretrained(model_path), "max_position_embeddings", None))


def run_max_model_len(max_completion_length: int, context: int | None) -> int:
    """The --max-model-len of a server started for a run: its completions plus a prompt,
    within the model's `context` (None: unknown; a model too short for the completions is
    reported by the server check)."""
    wanted = max(MANAGED_MAX_MODEL_LEN, max_completion_length + PROMPT_ROOM)
    return min(wanted, context) if context else wanted


def serve_command(model: str, *, port: int, max_model_len: int, max_logprobs: int = 20,
                  dtype: str | None = None, cpu: bool,
                  lora: tuple[int, int] | None = None) -> str:
    """The shell command that starts a server on this machine that training accepts, for
    messages that tell a user to start one: on CPU the one `ManagedVLLMServer` runs (gloo,
    through `vllm_entry`), on a GPU vLLM's own CLI with the NCCL engine (README). `lora`:
    the --max-lora-rank and --max-loras of a run with adapter sync (None: merged weights)."""
    env = dict(SERVER_ENV) | (LORA_ENV if lora else {})
    if cpu:
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", WAIT_SLEEP_ENV: str(CPU_WAIT_SLEEP_S)})
        program = ["python", "-m", "grpo_agent.sampler.vllm_entry", "serve"]
    else:
        program = ["vllm", "serve"]
    args = [*program, model, "--port", str(port),
            *training_flags(max_model_len, max_logprobs, "gloo" if cpu else "nccl")]
    if dtype:
        args += ["--dtype", dtype]
    if lora:
        args += lora_flags(*lora)
    return " ".join(f"{name}={value}" for name, value in env.items()) + " " + shlex.join(args)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The log's last lines, preceded by its first error line (vLLM's root cause is often
    far above the final "Engine core initialization failed")."""
    try:
        all_lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log written)"
    tail = all_lines[-lines:]
    causes = [line for line in all_lines[:-lines] if _ERROR_LINE.search(line)]
    return "\n".join(([f"first error: {causes[0]}", "..."] if causes else []) + tail)


class ManagedVLLMServer:
    """A `vllm serve` child process: `with ManagedVLLMServer(path) as server: server.base_url`.

    `nice`: run the server's whole session at this CPU priority, restarts included (the CLI
    passes `cpu_cores.SERVER_NICE` for a CPU server beside the trainer); None leaves it."""

    owned = True  # started by this process, so tests may push weights to it

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_model_len: int = 1024,
        dtype: str | None = None,
        max_logprobs: int = 20,
        weight_transfer_backend: str | None = "gloo",
        enable_lora: bool = False,
        max_lora_rank: int | None = None,
        max_loras: int | None = None,
        kv_cache_gib: float = 1.0,
        enforce_eager: bool = False,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike | None = None,
        startup_timeout: float = SERVER_STARTUP_TIMEOUT_S,
        env: dict[str, str] | None = None,
        nice: int | None = None,
    ):
        self.model = str(model)
        self.model_path = Path(model)
        self.host = host
        self.port = port
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.max_logprobs = max_logprobs
        self.weight_transfer_backend = weight_transfer_backend
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.kv_cache_gib = kv_cache_gib
        self.enforce_eager = enforce_eager
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path else _new_log_path()
        self.startup_timeout = startup_timeout
        self.extra_env = dict(env or {})
        self.nice = nice
        self.pid: int | None = None
        self.startup_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ManagedVLLMServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def command(self) -> list[str]:
        """The full command line (also shown in docs/vllm.md)."""
        args = [
            sys.executable, "-m", "grpo_agent.sampler.vllm_entry", "serve", self.model,
            "--host", self.host, "--port", str(self.port),
            *training_flags(self.max_model_len, self.max_logprobs, self.weight_transfer_backend),
            "--api-server-count", "1",
        ]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.enforce_eager:  # no torch.compile: starts faster, tiny models run faster too
            args.append("--enforce-eager")
        if self.enable_lora:
            args += lora_flags(self.max_lora_rank, self.max_loras)
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SERVER_ENV)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(self.kv_cache_gib))),
            "PYTHONUNBUFFERED": "1",
            OWNER_PID_ENV: str(os.getpid()),  # vllm_entry stops the server when we are gone
        })
        if self.enable_lora:
            env.update(LORA_ENV)
        if WAIT_SLEEP_ENV not in env and not _cuda_available():  # a user's value wins
            env[WAIT_SLEEP_ENV] = str(CPU_WAIT_SLEEP_S)  # vllm_wait: no spinning on CPU
        env.update(self.extra_env)
        sleep_seconds(env)  # a bad value fails here, not in the server's log
        return env

    def start(self) -> ManagedVLLMServer:
        """Launch the server and block until `/health` answers (or raise with the log tail)."""
        if self._process is not None:
            raise RuntimeError(f"server already started (pid {self.pid})")
        self._check_model_exists()
        if self.port is None:
            self.port = find_free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), start_new_session=True,
            )
        self.pid = self._process.pid
        if self.nice is not None:  # before it starts its engine and threads: they inherit it
            lower_priority(self.pid, self.nice)
        self._finalizer = weakref.finalize(self, _stop_process_group, self._process)
        logger.info("vLLM server pid %s starting on %s (log: %s)", self.pid, self.base_url,
                    self.log_path)
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        _RUNNING[self.base_url] = self
        return self

    def stop(self) -> None:
        """Stop our own process group (SIGTERM, then SIGKILL after a grace period)."""
        if _RUNNING.get(self.base_url) is self:
            del _RUNNING[self.base_url]
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_process_group once
            self._finalizer = None

    def restart(self) -> ManagedVLLMServer:
        """Stop what is left of the server (its engine may outlive a killed API process) and
        start it again on the same port, so clients keep their URL."""
        self.stop()
        self._process = None
        logger.info("restarting the vLLM server on %s (log: %s)", self.base_url, self.log_path)
        return self.start()

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _check_model_exists(self) -> None:
        # "org/name" may be a Hugging Face id; anything else with a slash or dot prefix is a path.
        looks_like_path = self.model.startswith(("/", ".", "~")) or self.model.count("/") > 1
        if looks_like_path and not self.model_path.expanduser().exists():
            raise FileNotFoundError(
                f"Model folder {self.model!r} does not exist. Pass a folder written by "
                f"save_pretrained (build a test model with `grpo-agent tiny-model DIR`) or a "
                f"Hugging Face model id."
            )

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise ServerStartupError(
                        f"vLLM server (pid {self.pid}) exited with code "
                        f"{self._process.returncode} before becoming ready. Last lines of "
                        f"{self.log_path}:\n{read_log_tail(self.log_path)}"
                    )
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(_HEALTH_POLL_S)
        raise ServerStartupError(
            f"vLLM server (pid {self.pid}) was not healthy after {self.startup_timeout:.0f} s. "
            f"Raise startup_timeout if the machine is busy. Last lines of {self.log_path}:\n"
            f"{read_log_tail(self.log_path)}"
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _new_log_path() -> Path:
    handle, name = tempfile.mkstemp(prefix="grpo-agent-vllm-", suffix=".log")
    os.close(handle)
    return Path(name)


def _stop_process_group(process: subprocess.Popen) -> None:
    """Signal the session we created for `process` (its PID is the group id). A second Ctrl-C
    while the server takes its grace period kills the group at once: before, it cut the wait
    short and left the server running until its owner watch noticed (`vllm_entry`)."""
    if process.poll() is not None:  # killed from outside: its engine may still run
        _reap_group_leftovers(process.pid)
        return
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
        except BaseException:
            _reap_group_leftovers(process.pid)
            raise
    _reap_group_leftovers(process.pid)


def _reap_group_leftovers(group_id: int) -> None:
    """vLLM's engine/worker children may outlive the API process briefly; kill our group's."""
    try:
        os.killpg(group_id, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
