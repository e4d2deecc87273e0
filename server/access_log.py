"""One log line per HTTP request at ``info``: method, path, status, prompt and completion tokens,
time to first token and total time, and the request's ``user`` (OpenAI's end-user id) if it named one.

The middleware puts a ``RequestUsage`` record in a context variable for the request's task; a
Generation started by the route fills it in as it ends, also when the response streams after the
route has returned (the streaming task inherits the context). Scrapes of ``/health`` and
``/metrics`` are logged at ``debug``, so a monitor does not fill the log.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger("phalanx.access")

QUIET_PATHS = frozenset({"/health", "/metrics"})


@dataclass
class RequestUsage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    user: str | None = None  # the request body's end-user id

    def record(self, prompt_tokens: int, completion_tokens: int, ttft_s: float | None) -> None:
        self.prompt_tokens, self.completion_tokens, self.ttft_s = prompt_tokens, completion_tokens, ttft_s


_current_usage: ContextVar[RequestUsage | None] = ContextVar("phalanx_request_usage", default=None)


def current_usage() -> RequestUsage | None:
    """The record of the HTTP request being served on this task (None outside one)."""
    return _current_usage.get()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class AccessLog:
    """Pure ASGI middleware (no extra task per request, streaming responses pass through)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        usage = RequestUsage()
        token = _current_usage.set(usage)
        status = 500  # what the client gets if the app fails before it answers

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _current_usage.reset(token)
            path = scope["path"]
            emit = log.debug if path in QUIET_PATHS else log.info
            generated = {}
            if usage.prompt_tokens is not None:  # the request ran a generation
                generated = dict(
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    ttft_ms=_ms(usage.ttft_s),
                )
            if usage.user is not None:
                generated["user"] = usage.user
            total_ms = _ms(time.monotonic() - started)
            emit("request", method=scope["method"], path=path, status=status, **generated, total_ms=total_ms)
