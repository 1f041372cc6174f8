"""How an exception reads in a message: `ValueError: bad row`, or just `AssertionError`.

One rule for every message that names an exception (a tool's error the model reads, the worker's
failure, a plugin's or an environment's refusal): `f"{type(e).__name__}: {e}"` alone leaves a
dangling colon after an exception raised without a message (a bare `assert`).
"""
from __future__ import annotations


def error_text(error: BaseException) -> str:
    """The exception's class name, then its message where it has one."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
