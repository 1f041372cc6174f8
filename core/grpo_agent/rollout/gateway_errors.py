"""The gateway's error type, apart so the chat and Responses API modules both raise it."""
from __future__ import annotations

from aiohttp import web


class GatewayError(Exception):
    """An error the agent sees as an OpenAI error body with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}
        return web.json_response(body, status=self.status)
