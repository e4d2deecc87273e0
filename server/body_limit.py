"""A request body size limit, enforced before any of the body is parsed.

A body whose ``Content-Length`` is over the limit is refused at once; a chunked body is read up to
the limit and refused as soon as it passes it. Either way the answer is a 413 in the OpenAI error
shape, and nothing past the limit is ever held in memory. A body within the limit is handed on as
it was read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phalanx.server.errors import error_body

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was in
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send, declared: int | None) -> None:
        self.on_refused()
        size = "" if declared is None else f" ({declared} bytes)"
        body = error_body(
            f"the request body{size} is larger than the {self.max_bytes}-byte limit",
            "invalid_request_error",
            code="request_too_large",
        )
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then the client's own messages (disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            message: dict[str, Any] = {"type": "http.request", "body": body, "more_body": False}
            return message
        return await receive()

    return replayed
