"""What every request passes before the app sees it: the API key, then a cap on the body.

A pure ASGI middleware (not Starlette's ``BaseHTTPMiddleware``), so the app's ``receive`` is the
server's own after the body: a client that goes away is seen at once (``http.disconnect``).

The body cap keeps a client from making the server read, parse and tokenize megabytes before the
context check refuses them: a ``Content-Length`` over the cap is refused before any of the body
is read, and a chunked body (no length given) is read only up to the cap. Either way the answer
is one 413 in OpenAI's error format.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BODY_BYTES_PER_TOKEN = 32
"""Request bytes one prompt token may take: English text is about 4 bytes a token, a CJK
character JSON-escaped as ``\\uXXXX`` 6, an emoji as a surrogate pair 12, a token id written out
(``"49151, "``) 7, and a long run of spaces in code up to about 32."""
MIN_BODY_BYTES = 1 << 20
"""The cap is never below 1 MiB (JSON overhead of many short chat messages)."""


def default_max_body_bytes(context: int) -> int:
    """The largest body a prompt that fits ``context`` tokens plausibly needs."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context)


def error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    """An error in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class RequestGuard:
    """API key on ``/v1/*`` (when set), then at most ``max_body_bytes`` of body;
    ``on_abandoned()`` when the client goes away before its body was read."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        on_abandoned: Callable[[], None] = lambda: None,
    ) -> None:
        self.app = app
        self.wanted = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_abandoned = on_abandoned

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.wanted is not None and scope["path"].startswith("/v1/"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.wanted):
                reply = error(
                    401,
                    "Missing or wrong API key; send 'Authorization: Bearer <key>'.",
                    "authentication_error",
                )
                await reply(scope, receive, send)
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length", b"")  # a malformed one: the HTTP parser's 400
            if length.isdigit() and int(length) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            body = await self._read(receive)
            if body is None:  # the client went away before the server read its request
                self.on_abandoned()
                return
            if len(body) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The body, or its first ``max_body_bytes + 1`` bytes; None if the client left."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            parts.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        reply = error(
            413,
            f"The request body is over this server's limit of {self.max_body_bytes} bytes "
            "(serve --max-body-bytes); send a shorter prompt.",
        )
        # the rest of the body is never read: the server closes the connection after the reply
        reply.headers["connection"] = "close"
        await reply(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands the app the body already read, then the server's messages (a
    later ``http.disconnect``)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
