"""One chat completion per sample, with bounded retries for transient failures."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

RETRIABLE_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class ChatResult:
    content: str
    reasoning: str
    finish_reason: str | None
    completion_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class ChatSettings:
    base_url: str
    model: str
    max_tokens: int
    temperature: float
    attempts: int = 6
    backoff_cap_s: float = 20.0


def _split_thinking(content: str, reasoning: str) -> tuple[str, str]:
    if "</think>" in content:
        thought, _, answer = content.partition("</think>")
        return answer, reasoning + thought.replace("<think>", "", 1)
    return content, reasoning


def _parse(body: dict) -> ChatResult:
    choice = body["choices"][0]
    message = choice.get("message") or {}
    content, reasoning = _split_thinking(
        message.get("content") or "", message.get("reasoning_content") or message.get("reasoning") or ""
    )
    usage = body.get("usage") or {}
    return ChatResult(content, reasoning, choice.get("finish_reason"), int(usage.get("completion_tokens", 0)))


async def chat(client: httpx.AsyncClient, settings: ChatSettings, prompt: str) -> ChatResult:
    """The model's reply, or a ChatResult whose ``error`` says why none came after every attempt."""
    payload = {
        "model": settings.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
    }
    url = settings.base_url.rstrip("/") + "/chat/completions"
    error = "no attempt made"
    for attempt in range(settings.attempts):
        try:
            response = await client.post(url, json=payload)
        except httpx.TransportError as e:
            error = f"{type(e).__name__}: {e}"
        else:
            if response.status_code == 200:
                try:
                    return _parse(response.json())
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    error = f"malformed response: {e!r}"
            else:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code not in RETRIABLE_STATUS:
                    break
        if attempt + 1 < settings.attempts:
            await asyncio.sleep(min(2.0**attempt, settings.backoff_cap_s))
    return ChatResult("", "", None, 0, error=f"{error} (after {attempt + 1} attempts)")
