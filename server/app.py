"""The FastAPI application: ``create_app(engine, model_dir)`` wires the engine, the tokenizer, the
chat template and metrics into the routes, and answers every error with an OpenAI-style body.
Every request is logged (``server.access_log``); with an API key, every route but health and
metrics wants it (``server.api_key``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from phalanx.engine.engine import Engine
from phalanx.server.access_log import AccessLog
from phalanx.server.api_key import ApiKeyCheck
from phalanx.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from phalanx.server.chat_template import ChatTemplate, ChatTemplateError
from phalanx.server.detokenizer import TextTokenizer
from phalanx.server.errors import ApiError, error_body
from phalanx.server.metrics import ServerMetrics
from phalanx.server.routes import router
from phalanx.server.service import ServerState
from phalanx.server.structured import GrammarCheck

log = structlog.get_logger("phalanx.server")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = _telling_error(exc.errors())
    location = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_branch(p)]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    where = ".".join(location)
    if first.get("type") == "extra_forbidden":
        return f"{where}: this field is not supported by this server", location[0]
    # pydantic words a validator's ValueError "Value error, <its text>": the text is the message
    message = str(first.get("msg")).removeprefix("Value error, ")
    return (f"{where}: {message}" if where else message), (location[0] if location else None)


def _telling_error(errors: Sequence[Any]) -> Any:
    """The error that says most. A field of several types (``prompt``: a string or lists) fails
    once per type; the branch whose type the value had failed on a constraint (a token id out of
    range), the others only on the type: that one, at its deepest place."""
    constraint_errors = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    if not constraint_errors:
        return errors[0]
    return max(constraint_errors, key=lambda e: len(e.get("loc", ())))


def _union_branch(part: object) -> bool:
    """Whether a location part names a branch of a union (``list[constrained-int]``, ``str``)."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_NAMES)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict"})


def create_app(
    engine: Engine,
    model_dir: str | Path,
    served_model_name: str | None = None,
    default_max_tokens: int | None = None,
    *,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """``chat_template`` (a file or the template's text) replaces the checkpoint's; a bad one
    raises ChatTemplateError."""
    model_dir = Path(model_dir)
    try:
        template: ChatTemplate | None = ChatTemplate.from_model_dir(model_dir, chat_template)
    except ChatTemplateError as e:
        if chat_template is not None:
            raise
        log.warning("no chat template: /v1/chat/completions will refuse requests", reason=str(e))
        template = None
    metrics = ServerMetrics(
        engine.stats, lambda: engine.poison_reason is not None, lambda: engine.rejected_frames
    )
    app = FastAPI(title="phalanx", docs_url=None, redoc_url=None)
    app.state.phalanx = ServerState(
        engine=engine,
        tokenizer=TextTokenizer.from_model_dir(model_dir),
        template=template,
        metrics=metrics,
        model_name=served_model_name or model_dir.name,
        grammar_check=GrammarCheck(model_dir, engine.model_info.vocab_size, engine.model_info.eos_token_ids),
        default_max_tokens=default_max_tokens,
    )
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, on_refused=metrics.rejected.inc)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key, on_refused=metrics.rejected.inc)
    app.add_middleware(AccessLog)  # outermost: refused requests are logged too

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if 400 <= exc.status < 499:  # 499: the client left, nothing was rejected
            metrics.rejected.inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.inc()
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # routing's own errors: an unknown path (404) or method (405)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(message, type_), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed", method=request.method, path=request.url.path)
        message = f"internal error in {request.method} {request.url.path}: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(message, "server_error"), status_code=500)

    return app
