"""math-verify in a helper process, so `accuracy_reward` scores from any thread.

math-verify bounds `parse` and `verify` with `signal.alarm`, which only works on a process's
main thread; the rollout worker runs sync rewards in threads, where `parse` raises. So checks
run in one long-lived helper process (`python -m grpo_agent.math_verifier`), on its main
thread, with math-verify's own 5 s timeouts intact (scores equal TRL's `accuracy_reward`),
one check at a time. A check the helper does not answer within `CHECK_TIMEOUT_S` (stuck where
the alarm cannot interrupt it) kills the helper and scores 0.0, as math-verify's own timeout
does; the next check starts a fresh helper.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 30.0  # math-verify's own limits add up to 15 s (two parses, one verify)
STARTUP_TIMEOUT_S = 120.0  # importing sympy on a busy machine


class MathVerifierError(RuntimeError):
    """The helper process could not be started or died mid-check."""


class MathVerifier:
    """A thread-safe client of one helper process (started on first use, restarted as needed)."""

    def __init__(self, check_timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.check_timeout_s = check_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()

    def check(self, answer: str, gold: str) -> float | None:
        """1.0 / 0.0 when `answer` matches / misses `gold`; None when `gold` does not parse."""
        request = (json.dumps({"answer": answer, "gold": gold}) + "\n").encode()
        with self._lock:
            proc = self._running()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
            except BrokenPipeError:
                self._forget()
                raise MathVerifierError(self._died_message(proc)) from None
            line = _read_line(proc, self.check_timeout_s)
            if line is None:
                logger.warning("math-verify did not answer within %.0f s; the completion scores "
                               "0.0 and the helper process is restarted.", self.check_timeout_s)
                self.close()
                return 0.0
            if not line:
                self._forget()
                raise MathVerifierError(self._died_message(proc))
        reply = json.loads(line)
        if "error" in reply:
            raise MathVerifierError(f"math-verify raised in the helper process:\n{reply['error']}")
        return reply["reward"]

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs (None before the first check)."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        """Stop the helper (it also exits by itself when our end of its stdin closes)."""
        proc, self._proc = self._proc, None
        if proc is None or self._owner_pid != os.getpid():
            return
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            stream.close()

    def _running(self) -> subprocess.Popen:
        if self._owner_pid != os.getpid():  # a forked copy: the helper belongs to the parent
            self._proc, self._owner_pid = None, os.getpid()
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=0, env=env)
        if _read_line(proc, STARTUP_TIMEOUT_S) != b'{"ready": true}':
            proc.kill()
            proc.wait()
            raise MathVerifierError(
                f"The math-verify helper process did not start within {STARTUP_TIMEOUT_S:.0f} s "
                f"(exit code {proc.returncode}; its stderr is above). Check that math-verify is "
                "installed: pip install 'math-verify>=0.7,<0.10'.")
        self._proc = proc
        return proc

    def _forget(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.wait()

    @staticmethod
    def _died_message(proc: subprocess.Popen) -> str:
        return (f"The math-verify helper process exited with code {proc.poll()} mid-check "
                "(its stderr is above); the next check starts a new one.")


def _read_line(proc: subprocess.Popen, timeout_s: float) -> bytes | None:
    """One reply line without its newline; b"" at EOF; None when `timeout_s` passes first."""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        data += chunk
    return data.rstrip(b"\n")


_SHARED = MathVerifier()
atexit.register(_SHARED.close)


def check_answer(answer: str, gold: str) -> float | None:
    """`MathVerifier.check` on the process-wide helper."""
    return _SHARED.check(answer, gold)


# ---------------------------------------------------------------------- the helper process

def _score(answer: str, gold: str) -> float | None:
    """TRL's accuracy check: gold parsed as is, the answer as LaTeX (e.g. `\\boxed{}`)."""
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.parser import NormalizationConfig

    gold_parsed = parse(gold, extraction_mode="first_match")
    if not gold_parsed:
        return None
    answer_config = [LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )]
    answer_parsed = parse(answer, extraction_config=answer_config, extraction_mode="first_match")
    return float(verify(gold_parsed, answer_parsed))


def _serve() -> None:
    import traceback

    import math_verify  # noqa: F401  (imported before "ready": the first check is not slowed)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; we exit at EOF
    out = os.fdopen(os.dup(1), "wb")  # replies only: stray prints go to stderr
    os.dup2(2, 1)
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            reply = {"reward": _score(request["answer"], request["gold"])}
        except Exception:  # noqa: BLE001  (reported to the caller, which raises it)
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
