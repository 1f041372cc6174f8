"""The gateway's error type and the checks the chat and Responses API modules share, apart so
both can raise them."""
from __future__ import annotations

import json

from aiohttp import web


class GatewayError(Exception):
    """An error the agent sees as an OpenAI error body with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> web.Response:
        """The error body; a 4xx also says `x-should-retry: false`, which the `openai` SDK obeys:
        it otherwise retries a 429 twice with backoff, and asking again never makes a spent
        rollout budget answer (a sync client waited 1.2 s a call and was counted 3 times)."""
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}
        headers = {"x-should-retry": "false"} if self.status < 500 else None
        return web.json_response(body, status=self.status, headers=headers)


def check_tool_name(name, param: str) -> None:
    """A function tool's name, checked: the chat template renders a tool without one silently,
    so the model would be trained on a tool it cannot call instead of the agent getting a 400."""
    if not isinstance(name, str) or not name:
        raise GatewayError(400, f"{param} must be a non-empty string (the function's name), got "
                           f"{json.dumps(name)[:200]}.", param=param)
