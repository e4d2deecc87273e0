"""The HTTP endpoints: models, completions, chat completions, health, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from phalanx.server.choices import Choice, response, stream
from phalanx.server.errors import ApiError, bad_request, error_body
from phalanx.server.generation import GenerationError
from phalanx.server.json_body import MsgspecJsonRoute
from phalanx.server.openai_format import (
    ChatFormat,
    Collected,
    CompletionFormat,
    collect,
    vllm_prompt_logprobs,
)
from phalanx.server.reasoning import ReasoningSplitter
from phalanx.server.schemas import ChatCompletionRequest, CompletionRequest
from phalanx.server.service import ServerState

router = APIRouter(route_class=MsgspecJsonRoute)

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


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "phalanx",
        "max_model_len": state.max_context,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    if model_id != state.model_name:
        raise ApiError(
            404,
            f"model {model_id!r} does not exist here; this server serves {state.model_name!r}",
            "not_found_error",
            param="model",
            code="model_not_found",
        )
    return _model_card(state)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = _state(request)
    state.check_model(body.model)
    if body.max_tokens == 0 and not body.echo:  # nothing generated and nothing echoed
        raise bad_request(
            "max_tokens: 0 is accepted only with echo (the answer is the prompt)", param="max_tokens"
        )

    def prompt_ids() -> list[list[int]]:
        return [state.completion_prompt_ids(prompt) for prompt in body.prompts]

    # Tokenizing (a long prompt, many prompts) runs off the event loop, so other streams go on;
    # token ids have nothing to tokenize, and the thread hop would add ~0.3 ms to their TTFT.
    token_ids_only = all(isinstance(prompt, list) for prompt in body.prompts)
    prompts = prompt_ids() if token_ids_only else await run_in_threadpool(prompt_ids)
    choices = state.start_choices(prompts, body, body.max_tokens, body.logprobs, body.prompt_top_logprobs)
    fmt = CompletionFormat(
        state.tokenizer,
        state.model_name,
        want_logprobs=body.logprobs is not None,
        echo=body.echo,
        want_prompt_logprobs=body.prompt_logprobs is not None,
    )
    if body.stream:
        return _sse(stream(fmt, choices, body.include_usage))
    return JSONResponse(response(fmt, choices, await _collect_unless_gone(choices, request)))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = _state(request)
    state.check_model(body.model)
    prompt_text, prompt_ids = await run_in_threadpool(state.chat_prompt, body)
    in_reasoning = ReasoningSplitter.prompt_opens_reasoning(prompt_text)
    choices = state.start_choices(
        [prompt_ids],
        body,
        body.requested_max_tokens,
        body.logprobs_count,
        body.prompt_logprobs,
        opens_reasoning=in_reasoning,
    )
    fmt = ChatFormat(
        state.tokenizer,
        state.model_name,
        want_logprobs=body.logprobs,
        starts_in_reasoning=in_reasoning,
        parses_tool_calls=body.parses_tool_calls,
        parallel_tool_calls=body.parallel_tool_calls,
        tools=body.tools,
    )
    if body.stream:
        return _sse(stream(fmt, choices, body.include_usage))
    results = await _collect_unless_gone(choices, request)
    whole = response(fmt, choices, results)
    if body.prompt_logprobs is not None:  # vLLM answers them beside the choices
        whole["prompt_logprobs"] = vllm_prompt_logprobs(state.tokenizer, prompt_ids, results[0].prompt)
    return JSONResponse(whole)


async def _collect_unless_gone(choices: list[Choice], request: Request) -> list[Collected]:
    """Every choice's whole generation; all cancelled (freeing their slots and pages) if the
    client disconnects."""
    task = asyncio.ensure_future(asyncio.gather(*(collect(choice.generation) for choice in choices)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client disconnected", "client_closed_request")
        return list(task.result())
    except GenerationError as e:
        if e.rejected:
            raise bad_request(str(e)) from e
        closed = _state(request).engine.closed_reason is not None  # poisoned, or stopping
        raise ApiError(503 if closed else 500, str(e), "server_error") from e
    finally:
        if not task.done():
            task.cancel()


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def frames() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield _frame(event)
        except GenerationError as e:
            kind = "invalid_request_error" if e.rejected else "server_error"
            yield _frame(error_body(str(e), kind))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _frame(event: dict[str, Any]) -> bytes:
    """One server-sent event. msgspec writes a chunk in a tenth of json.dumps's time (every token
    of every stream passes here) and writes a non-finite float as null, which is valid JSON."""
    return b"data: " + msgspec.json.encode(event) + b"\n\n"
