"""``--api-key``: every route but ``/health`` and ``/metrics`` wants ``Authorization: Bearer KEY``
(what OpenAI clients send); anything else is answered 401 in OpenAI's error shape."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from phalanx.server.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


def _refusal(headers: Headers, api_key: str) -> str | None:
    """Why this request's credentials are refused, or None when they carry the key."""
    authorization = headers.get("authorization")
    if not authorization:
        return "no API key given: send it as 'Authorization: Bearer KEY'"
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return f"the Authorization header must use the Bearer scheme, got {scheme!r}"
    if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        return "incorrect API key"
    return None


class ApiKeyCheck:
    def __init__(self, app: ASGIApp, api_key: str, on_refused: Callable[[], object]) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self.api_key = api_key
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            refusal = _refusal(Headers(scope=scope), self.api_key)
            if refusal is not None:
                self.on_refused()
                body = error_body(refusal, "invalid_request_error", code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
