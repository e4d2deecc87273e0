"""The HTTP endpoints: models, completions, chat completions, health, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from server.errors import ApiError, error_body
from server.generation import Generation, GenerationError
from server.openai_format import ChatFormat, Collected, CompletionFormat, collect
from server.reasoning import ReasoningSplitter
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.service import ServerState

router = APIRouter()

DISCONNECT_POLL_S = 0.25


def _state(request: Request) -> ServerState:
    return request.app.state.phalanx


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    reason = _state(request).engine.poison_reason
    if reason is not None:
        return JSONResponse({"status": "poisoned", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    model = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "phalanx",
        "max_model_len": state.max_context,
    }
    return {"object": "list", "data": [model]}


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = _state(request)
    state.check_model(body.model)
    prompt_ids = await run_in_threadpool(state.completion_prompt_ids, body.prompt)
    generation = state.start(prompt_ids, body, body.max_tokens, body.logprobs)
    fmt = CompletionFormat(state.tokenizer, state.model_name, want_logprobs=body.logprobs is not None)
    if body.stream:
        return _sse(fmt.stream(generation, body.include_usage))
    return JSONResponse(fmt.response(await _collect_unless_gone(generation, request)))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = _state(request)
    state.check_model(body.model)
    prompt_text, prompt_ids = await run_in_threadpool(state.chat_prompt, body)
    generation = state.start(prompt_ids, body, body.requested_max_tokens, body.logprobs_count)
    fmt = ChatFormat(
        state.tokenizer,
        state.model_name,
        want_logprobs=body.logprobs,
        starts_in_reasoning=ReasoningSplitter.prompt_opens_reasoning(prompt_text),
    )
    if body.stream:
        return _sse(fmt.stream(generation, body.include_usage))
    return JSONResponse(fmt.response(await _collect_unless_gone(generation, request)))


async def _collect_unless_gone(generation: Generation, request: Request) -> Collected:
    """The whole generation; cancelled (freeing its slot and pages) if the client disconnects."""
    task = asyncio.ensure_future(collect(generation))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client disconnected", "client_closed_request")
        return task.result()
    except GenerationError as e:
        closed = _state(request).engine.closed_reason is not None  # poisoned, or stopping
        raise ApiError(503 if closed else 500, str(e), "server_error") from e
    finally:
        if not task.done():
            task.cancel()


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def frames() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except GenerationError as e:
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
