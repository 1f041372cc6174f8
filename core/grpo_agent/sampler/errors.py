"""Errors raised by the sampler layer.

Split by what the caller can do about them: an unreachable server (check the URL or restart
it), a request the server rejected for good (fix the request; retrying cannot help), and
everything else that survived the bounded retries.
"""


class SamplerError(RuntimeError):
    """A sampler call failed after its bounded retries."""


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


class WeightSyncError(SamplerError):
    """A weight push failed; the server may need a restart if the engine died."""
