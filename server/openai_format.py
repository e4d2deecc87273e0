"""Generation output as OpenAI response bodies: whole responses and streamed chunks, for
``text_completion`` and ``chat.completion``, with usage and logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from server.detokenizer import TextTokenizer
from server.generation import Chunk, Done, Generation, TokenInfo
from server.reasoning import ReasoningSplitter


def usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


@dataclass
class Collected:
    text: str
    tokens: list[TokenInfo]
    done: Done


async def collect(generation: Generation) -> Collected:
    texts: list[str] = []
    tokens: list[TokenInfo] = []
    async for item in generation:
        if isinstance(item, Chunk):
            texts.append(item.text)
            tokens += item.tokens
        else:
            return Collected("".join(texts), tokens, item)
    raise RuntimeError(f"request {generation.request_id} ended without a final event")


@dataclass
class _Response:
    tokenizer: TextTokenizer
    model: str
    want_logprobs: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


@dataclass
class CompletionFormat(_Response):
    def __post_init__(self) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"

    def _top(self, token: TokenInfo) -> dict[str, float] | None:
        """vLLM's entry: the chosen token first, then the top N by text; two ids with one text
        keep the first (so the chosen token's own logprob is never overwritten)."""
        if token.logprob is None:
            return None
        top: dict[str, float] = {self.tokenizer.token_text(token.token_id): token.logprob}
        for token_id, logprob in token.top_logprobs or []:
            top.setdefault(self.tokenizer.token_text(token_id), logprob)
        return top

    def _logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {
            "tokens": [self.tokenizer.token_text(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [self._top(t) for t in tokens],
            "text_offset": [t.text_offset for t in tokens],
        }

    def response(self, result: Collected) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": result.text,
            "logprobs": self._logprobs(result.tokens),
            "finish_reason": result.done.finish_reason,
        }
        return {**self._envelope("text_completion", [choice]), "usage": usage(result.done)}

    async def stream(self, generation: Generation, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        async for item in generation:
            if isinstance(item, Chunk):
                if item.text or item.tokens:
                    choice = {
                        "index": 0,
                        "text": item.text,
                        "logprobs": self._logprobs(item.tokens),
                        "finish_reason": None,
                    }
                    yield self._envelope("text_completion", [choice])
                continue
            final = {"index": 0, "text": "", "logprobs": None, "finish_reason": item.finish_reason}
            yield self._envelope("text_completion", [final])
            if include_usage:
                yield {**self._envelope("text_completion", []), "usage": usage(item)}


@dataclass
class ChatFormat(_Response):
    starts_in_reasoning: bool = False

    def __post_init__(self) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"

    def _logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None

        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            raw = self.tokenizer.token_bytes(token_id)
            return {"token": self.tokenizer.token_text(token_id), "logprob": logprob, "bytes": list(raw)}

        return {
            "content": [
                {
                    **entry(t.token_id, t.logprob),
                    "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or []],
                }
                for t in tokens
            ]
        }

    def response(self, result: Collected) -> dict[str, Any]:
        splitter = ReasoningSplitter(self.starts_in_reasoning)
        reasoning, content = splitter.push(result.text)
        more_reasoning, more_content = splitter.flush()
        message: dict[str, Any] = {"role": "assistant", "content": content + more_content}
        if reasoning + more_reasoning:
            message["reasoning_content"] = reasoning + more_reasoning
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(result.tokens),
            "finish_reason": result.done.finish_reason,
        }
        return {**self._envelope("chat.completion", [choice]), "usage": usage(result.done)}

    def _chunk(
        self, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope("chat.completion.chunk", [choice])

    @staticmethod
    def _delta(reasoning: str, content: str) -> dict[str, str]:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta

    async def stream(self, generation: Generation, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        splitter = ReasoningSplitter(self.starts_in_reasoning)
        yield self._chunk({"role": "assistant", "content": ""})
        async for item in generation:
            if isinstance(item, Chunk):
                delta = self._delta(*splitter.push(item.text))
                if delta or (item.tokens and self.want_logprobs):
                    yield self._chunk(delta, self._logprobs(item.tokens))
                continue
            yield self._chunk(self._delta(*splitter.flush()), finish=item.finish_reason)
            if include_usage:
                yield {**self._envelope("chat.completion.chunk", []), "usage": usage(item)}
