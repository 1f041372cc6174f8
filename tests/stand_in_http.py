"""The answer of the tests' stand-in HTTP servers (`BaseHTTPRequestHandler` subclasses)."""
from __future__ import annotations

import json


def send_reply(handler, body, status: int = 200, content_type: str = "application/json") -> None:
    """Answer `handler`'s request: bytes as given, a str encoded, anything else as JSON."""
    if isinstance(body, bytes):
        payload = body
    else:
        payload = (body if isinstance(body, str) else json.dumps(body)).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)
