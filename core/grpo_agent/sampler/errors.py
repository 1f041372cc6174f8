"""Errors raised by the sampler layer.

Split by what the caller can do about them: an unreachable server (check the URL or restart
it), a request the server rejected for good (fix the request; retrying cannot help), and
everything else that survived the bounded retries. The retry rule both HTTP clients (the
sampler's and the control calls') follow lives here too, so their errors read the same.
"""
from typing import Any

RETRYABLE_STATUS = range(500, 600)


class SamplerError(RuntimeError):
    """A sampler call failed after its bounded retries.

    `reason`: what failed, in one line and without the advice a message may end with (start
    a server, pass the right URL), for the logs where that advice is wrong: the rollout
    worker's note of a lost server while the trainer restores it. `start_command`: the command
    that starts the server the caller needs, where the message names one; the CLI prints it
    whole (its one-line summary cuts long messages)."""

    def __init__(self, *args: Any, reason: str | None = None,
                 start_command: str | None = None) -> None:
        super().__init__(*args)
        self._reason = reason
        self.start_command = start_command

    @property
    def reason(self) -> str:
        text = str(self).strip()
        return self._reason or (text.splitlines()[0] if text else type(self).__name__)

    def __reduce__(self):
        """Pickle without calling `__init__` again: errors cross process boundaries (the rollout
        worker's to the trainer), and a subclass with required keyword-only arguments
        (`RequestRejectedError`) cannot be rebuilt from `args` alone."""
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> SamplerError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class ServerUnreachableError(SamplerError):
    """Nothing answered at the server URL (not started, crashed, or wrong address)."""


class RequestRejectedError(SamplerError):
    """The server rejected the request with a 4xx; the message carries the server's text."""

    def __init__(self, message: str, *, status_code: int, server_message: str = ""):
        super().__init__(message)
        self.status_code = status_code
        self.server_message = server_message


class ServerStartupError(SamplerError):
    """A managed vLLM server died or never became healthy; the message ends with its log."""


class ServerChangedError(SamplerError):
    """A server that came back mid-run is unfit for the run (another model, a shorter
    max_model_len): training on it would credit another model's samples to this one."""


class ServerUnfitError(ValueError):
    """A server the start checks refuse (`server_facts.check_training_server`): training on it
    would go wrong. `start_command`: the command that starts one they accept (as on
    `SamplerError`), which the message names too."""

    def __init__(self, message: str, *, start_command: str | None = None) -> None:
        super().__init__(message)
        self.start_command = start_command


class WeightSyncError(SamplerError):
    """A weight push failed; the server may need a restart if the engine died."""


def retry_delay_s(attempt: int) -> float:
    """The pause before retry number `attempt` (1, 2, ...): 0.25 s doubling, at most 4 s."""
    return min(0.25 * 2 ** (attempt - 1), 4.0)


def server_message(response: Any) -> str:
    """The server's own words from an error response (vLLM's JSON `error.message`/`detail`)."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:2000] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)
        return str(data.get("detail") or error)
    return str(data)


def rejected_error(method: str, url: str, response: Any) -> RequestRejectedError:
    message = server_message(response)
    return RequestRejectedError(
        f"{method} {url} was rejected with HTTP {response.status_code}: {message}",
        status_code=response.status_code, server_message=message,
    )


def exhausted_error(method: str, base_url: str, path: str, problem: str,
                    attempts: int) -> SamplerError:
    """What a call that failed `attempts` times raises; `problem` is the last failure."""
    if problem.startswith(("ConnectError", "ConnectTimeout")):
        reason = f"No vLLM server answered at {base_url} ({problem}) after {attempts} attempts"
        # Not a command: this client does not know the run's model and lengths, and a partial
        # one starts a server the run's checks refuse; the start check names the whole one.
        return ServerUnreachableError(
            f"{reason}. Start one with the flags training needs (docs/vllm.md, Server flags; a "
            "run that finds no server at start names the whole command) or pass the right URL.",
            reason=reason)
    return SamplerError(f"{method} {base_url}{path} failed after {attempts} attempts: {problem}")
