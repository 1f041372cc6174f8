"""The limits a command agent runs under, and the command line that applies them.

Design decision: a command agent is any program (a Python script, a shell script with curl), so
the confinement is the kernel's, set up by `_agent_boot.py` before it execs the command: a new
network namespace whose only reachable address is a relay to the gateway (the agent cannot
reach the vLLM server, the trainer or the internet), a PID namespace when root (nothing
outlives the run), rlimits on memory, file size, open files and CPU time, and, with `user`, a
dedicated unprivileged user (no writes to the trainer's files; a cap on processes). The
trainer's secrets are not passed on: variables whose names look like credentials are dropped.
What is not confined: reading files the user can read, and the wall time, which the caller
enforces by killing the process group.
"""
from __future__ import annotations

import json
import math
import os
import pwd
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

BOOT_SCRIPT = Path(__file__).resolve().parent.parent / "_agent_boot.py"
ISOLATION_FAILED_EXIT = 97
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY", re.IGNORECASE)


@dataclass(frozen=True)
class CommandLimits:
    """What one command-agent run may use.

    `network`: "gateway" (only the gateway is reachable; needs root or unprivileged user
    namespaces) or "any" (no network confinement). `user`: run as this user (root only; it
    must be able to read and run the command, e.g. "nobody" for `/bin/sh` scripts); it also
    makes `max_processes` bind, since that rlimit counts all of a user's processes.
    """

    memory_mb: int = 4096  # address space (RLIMIT_AS)
    max_file_bytes: int = 64 * 1024 * 1024
    max_open_files: int = 256
    max_processes: int = 64
    network: str = "gateway"
    user: str | None = None

    def __post_init__(self):
        if self.network not in ("gateway", "any"):
            raise ValueError(f"CommandLimits.network is {self.network!r}: use 'gateway' (only the "
                             "gateway is reachable) or 'any' (no network confinement).")
        if self.user is None:
            return
        try:  # here, not as a traceback from every rollout's boot script; first, as any uid errs
            pwd.getpwnam(self.user)
        except KeyError:
            raise ValueError(f"CommandLimits.user={self.user!r}: no such user on this machine; "
                             "name an existing one, e.g. 'nobody'.") from None
        if os.getuid() != 0:
            raise ValueError(f"CommandLimits.user={self.user!r} needs the trainer to run as root "
                             "(only root can switch users); leave user=None.")


def sandboxed_argv(limits: CommandLimits, argv: list[str], *, gateway_port: int,
                   gateway_socket: str | None, home: str, timeout_s: float) -> list[str]:
    """`argv` wrapped in the boot script with these limits (CPU time capped by the wall time)."""
    boot = {**asdict(limits), "gateway_port": gateway_port, "gateway_socket": gateway_socket,
            "home": home, "cpu_s": max(1, math.ceil(timeout_s))}
    return [sys.executable, "-I", "-S", str(BOOT_SCRIPT), json.dumps(boot), *argv]  # stdlib only


def agent_environment(base_url: str, key: str, home: str) -> dict[str, str]:
    """The trainer's environment without credentials, plus the gateway and a private HOME."""
    env = {name: value for name, value in os.environ.items() if not SECRET_NAME.search(name)}
    return {**env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "HOME": home,
            "TMPDIR": home}
