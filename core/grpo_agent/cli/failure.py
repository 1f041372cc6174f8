"""What a run that cannot go on prints: what failed, where its log is, what to do, and an exit code.

Design decision: two pages of chained tracebacks from the trainer and the worker tell a user
less than three lines that name the failure and the next step. The full traceback (chained
causes included) goes to `error.log` in the output dir (a temp file when that dir cannot be
written, e.g. the disk is full) and to the terminal only with `--debug`.
"""
from __future__ import annotations

import contextlib
import errno
import re
import tempfile
import traceback
from pathlib import Path

from grpo_agent.stall import STALL_EXIT_CODE, StageStalled

ERROR_LOG_NAME = "error.log"
FAILED_EXIT_CODE = 1
_MODULE_PATH = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*: )")  # "pkg.mod." of "pkg.mod.Error: ..."


def write_traceback(error: BaseException, output_dir: str | Path | None) -> Path:
    """The full traceback in `output_dir/error.log`, or in a temp file if that cannot be written."""
    text = "".join(traceback.format_exception(error))
    if output_dir is not None:
        path = Path(output_dir) / ERROR_LOG_NAME
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return path
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # a part written before the disk filled up
    with tempfile.NamedTemporaryFile("w", prefix="grpo-agent-error-", suffix=".log", delete=False) as fh:
        fh.write(text)
    return Path(fh.name)


def is_disk_full(error: BaseException) -> bool:
    """A full disk (or file size limit) anywhere in the chain; safetensors words it only in its message."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if "No space left on device" in str(error) or "File too large" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def advice(error: BaseException, output_dir: str | Path | None) -> str:
    """The next step for a user, by the kind of failure."""
    from grpo_agent.rollout.scoring import RewardFunctionError
    from grpo_agent.rollout.worker import RolloutWorkerError, RolloutWorkerHung
    from grpo_agent.sampler.errors import SamplerError
    from grpo_agent.train.checkpoint import CLI_RESUME, resume_advice
    from grpo_agent.train.no_progress import NoProgressStalled

    if is_disk_full(error):
        return (f"free disk space where {output_dir} lives (or pass another --output-dir); a "
                "checkpoint cut short is skipped on resume (it has no rollout_state.json).")
    if isinstance(error, NoProgressStalled):
        return ("no group trained: fix the likely cause named above (stall_report.json counts "
                "the dropped groups); a larger no_progress_timeout only waits longer.")
    if isinstance(error, StageStalled):
        return "read stall_report.json; raise stall_timeouts for that stage if it is only slow."
    if isinstance(error, RewardFunctionError):
        return "fix the reward function named above; the traceback shows where it failed."
    go_on = resume_advice(output_dir, CLI_RESUME)
    command = getattr(error, "start_command", None)
    if command:  # whole: the summary line above may cut it
        return f"start the server with `{command}` (or pass the right --vllm-url), then {go_on}."
    if isinstance(error, SamplerError):
        return f"check the vLLM server (its log is named above or in error.log), then {go_on}."
    if isinstance(error, RolloutWorkerHung):
        return ("find what blocks the rollout worker (the suspects are named above), or raise "
                f"rollout_worker_timeout if it is only slow; then {go_on}.")
    if isinstance(error, RolloutWorkerError):
        return ("the rollout worker's traceback is in error.log; fix the failing reward, tool, "
                f"environment or plugin, then {go_on}.")
    return f"read the traceback in error.log (or run with --debug); then {go_on}."

def report_failure(error: BaseException, output_dir: str | Path | None,
                   since: float | None = None) -> tuple[str, int]:
    """Write the traceback; return the short message and the exit code (3 for a stall).
    `since`: when the run began (`time.time()`); a stall report older than that is an earlier
    run's (one resumed into the same output dir) and is not named."""
    log = write_traceback(error, output_dir)
    lines = [line for line in str(error).strip().splitlines() if line.strip()] or [""]
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        # A message that carries a traceback ("... Its last traceback:"): its last line is the
        # reason (its exception's class without the module path: the message is what matters).
        first = f"{first} {_MODULE_PATH.sub('', lines[-1].strip())}"
    what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    if len(what) > 300:  # keep the end too: our messages end with the fix, after the server's text
        what = what[:180] + " [...] " + what[-120:]
    message = [f"Error: the run failed: {what}", f"  full traceback: {log}"]
    stall_report = Path(output_dir) / "stall_report.json" if output_dir is not None else None
    if stall_report is not None and _written_since(stall_report, since):
        message.append(f"  stall report: {stall_report}")
    message.append(f"  what to do: {advice(error, output_dir)}")
    code = STALL_EXIT_CODE if isinstance(error, StageStalled) else FAILED_EXIT_CODE
    return "\n".join(message), code


def _written_since(path: Path, since: float | None) -> bool:
    try:
        return since is None or path.stat().st_mtime >= since
    except OSError:  # not there
        return False
