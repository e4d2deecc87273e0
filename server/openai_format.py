"""Generation output as OpenAI response parts: each choice whole or as streamed chunks, for
``text_completion`` (with echo and vLLM's prompt logprobs) and ``chat.completion``, with logprobs.
``server.choices`` puts a request's choices into one response."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from phalanx.server.detokenizer import IncrementalDetokenizer, TextTokenizer
from phalanx.server.generation import Chunk, Done, Generation, PromptScores, PromptToken, TokenInfo
from phalanx.server.reasoning import ReasoningSplitter
from phalanx.server.tool_calls import ToolCallParser, whole_calls


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Collected:
    text: str
    tokens: list[TokenInfo]
    done: Done
    prompt: list[PromptToken] = field(default_factory=list)  # scored prompt tokens, when asked


async def collect(generation: Generation) -> Collected:
    texts: list[str] = []
    tokens: list[TokenInfo] = []
    prompt: list[PromptToken] = []
    async for item in generation:
        if isinstance(item, PromptScores):
            prompt += item.tokens
        elif isinstance(item, Chunk):
            texts.append(item.text)
            tokens += item.tokens
        else:
            return Collected("".join(texts), tokens, item, prompt)
    raise RuntimeError(f"request {generation.request_id} ended without a final event")


def vllm_prompt_logprobs(
    tokenizer: TextTokenizer, prompt_ids: list[int], scored: list[PromptToken]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token a dict keyed by token
    id holding the token itself and the top N, each with its logprob, rank and text."""

    def entry(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, token in zip(prompt_ids[1:], scored, strict=True):
        top = {str(i): entry(lp, rank, i) for rank, (i, lp) in enumerate(token.top_logprobs or [], start=1)}
        out.append({str(token_id): entry(token.logprob, token.rank, token_id), **top})
    return out


@dataclass
class _Response:
    tokenizer: TextTokenizer
    model: str
    want_logprobs: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


@dataclass
class CompletionFormat(_Response):
    echo: bool = False
    want_prompt_logprobs: bool = False
    object_: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    def __post_init__(self) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"

    def _top(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, float]:
        """vLLM's entry: the chosen token first, then the top N by text; two ids with one text
        keep the first (so the chosen token's own logprob is never overwritten)."""
        entry: dict[str, float] = {self.tokenizer.token_text(token_id): logprob}
        for other, other_logprob in top or []:
            entry.setdefault(self.tokenizer.token_text(other), other_logprob)
        return entry

    def _logprobs(self, tokens: list[TokenInfo], shift: int = 0) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {
            "tokens": [self.tokenizer.token_text(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                None if t.logprob is None else self._top(t.token_id, t.logprob, t.top_logprobs)
                for t in tokens
            ],
            "text_offset": [shift + t.text_offset for t in tokens],
        }

    def _echoed(self, prompt_ids: list[int], scored: list[PromptToken]) -> tuple[str, dict[str, Any] | None]:
        """What precedes the generated text: with ``echo`` the prompt's text and, with logprobs,
        its tokens' entries (the first token has none); else nothing."""
        if not self.echo:
            return "", None
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        pieces = [detokenizer.push(token_id) for token_id in prompt_ids]
        pieces[-1] += detokenizer.flush()
        offsets = [0, *itertools.accumulate(len(piece) for piece in pieces)][:-1]
        text = "".join(pieces)
        if not self.want_logprobs:
            return text, None
        firsts: list[PromptToken | None] = [None, *scored]
        return text, {
            "tokens": [self.tokenizer.token_text(i) for i in prompt_ids],
            "token_logprobs": [None if s is None else s.logprob for s in firsts],
            "top_logprobs": [
                None if s is None else self._top(i, s.logprob, s.top_logprobs)
                for i, s in zip(prompt_ids, firsts, strict=True)
            ],
            "text_offset": offsets,
        }

    def _opening(
        self, index: int, prompt_ids: list[int], scored: list[PromptToken], text: str, tokens: list[TokenInfo]
    ) -> dict[str, Any]:
        """A choice whose text starts with the echoed prompt (if asked), then ``text``; with its
        logprobs and vLLM's prompt_logprobs (if asked)."""
        prompt_text, prompt_logprobs = self._echoed(prompt_ids, scored)
        logprobs = self._logprobs(tokens, shift=len(prompt_text))
        if prompt_logprobs is not None and logprobs is not None:
            logprobs = {key: prompt_logprobs[key] + logprobs[key] for key in logprobs}
        choice: dict[str, Any] = {"index": index, "text": prompt_text + text, "logprobs": logprobs}
        if self.want_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, prompt_ids, scored)
        return choice

    def choice(self, index: int, prompt_ids: list[int], result: Collected) -> dict[str, Any]:
        choice = self._opening(index, prompt_ids, result.prompt, result.text, result.tokens)
        return {**choice, "finish_reason": result.done.finish_reason}

    async def stream_choice(
        self, index: int, prompt_ids: list[int], generation: Generation
    ) -> AsyncIterator[dict[str, Any] | Done]:
        """The choice's chunks (``index`` in each), then its Done. As vLLM: the echoed prompt and
        its logprobs come in the first chunk, with the first generated text (and here the prompt
        logprobs too, which vLLM refuses to stream)."""
        scored: list[PromptToken] = []
        opened = not (self.echo or self.want_prompt_logprobs)
        shift = 0  # characters of echoed prompt before the generated text
        async for item in generation:
            if isinstance(item, PromptScores):
                scored += item.tokens
                continue
            if not opened:  # the prompt goes out with the first text, or alone before the end
                opened = True
                first = item if isinstance(item, Chunk) else Chunk("")
                opening = self._opening(index, prompt_ids, scored, first.text, first.tokens)
                shift = len(opening["text"]) - len(first.text)
                yield {**opening, "finish_reason": None}
                if isinstance(item, Chunk):
                    continue
            if isinstance(item, Chunk):
                if item.text or item.tokens:
                    logprobs = self._logprobs(item.tokens, shift)
                    yield {"index": index, "text": item.text, "logprobs": logprobs, "finish_reason": None}
            elif isinstance(item, Done):
                yield {"index": index, "text": "", "logprobs": None, "finish_reason": item.finish_reason}
                yield item


@dataclass
class ChatFormat(_Response):
    starts_in_reasoning: bool = False
    parses_tool_calls: bool = False  # the request offered tools: the reply's <tool_call> blocks are calls
    parallel_tool_calls: bool = True
    tools: list[dict[str, Any]] | None = None  # the offered tools: their parameters' types
    object_: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

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

    def _finish(self, reason: str, calls: int) -> str:
        return "tool_calls" if calls and reason == "stop" else reason

    def _tool_parser(self) -> ToolCallParser | None:
        """Without ``parallel_tool_calls`` only a reply's first call is returned."""
        if not self.parses_tool_calls:
            return None
        return ToolCallParser(max_calls=None if self.parallel_tool_calls else 1, tools=self.tools)

    def choice(self, index: int, prompt_ids: list[int], result: Collected) -> dict[str, Any]:
        splitter = ReasoningSplitter(self.starts_in_reasoning)
        reasoning, content = splitter.push(result.text)
        more_reasoning, more_content = splitter.flush()
        content += more_content
        calls: list[dict[str, Any]] = []
        tools = self._tool_parser()
        if tools is not None:
            content, deltas = tools.push(content, end=True)
            calls = whole_calls(deltas)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if reasoning + more_reasoning:
            message["reasoning_content"] = reasoning + more_reasoning
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(result.tokens),
            "finish_reason": self._finish(result.done.finish_reason, len(calls)),
        }

    @staticmethod
    def _delta(reasoning: str, content: str) -> dict[str, str]:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta

    async def stream_choice(
        self, index: int, prompt_ids: list[int], generation: Generation
    ) -> AsyncIterator[dict[str, Any] | Done]:
        """The choice's chunks (``index`` in each), then its Done."""

        def chunk(delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        splitter = ReasoningSplitter(self.starts_in_reasoning)
        tools = self._tool_parser()

        def delta(reasoning: str, content: str, end: bool = False) -> dict[str, Any]:
            if tools is None:
                return self._delta(reasoning, content)
            content, calls = tools.push(content, end)
            out: dict[str, Any] = self._delta(reasoning, content)
            if calls:
                out["tool_calls"] = calls
            return out

        yield chunk({"role": "assistant", "content": ""})
        async for item in generation:
            if isinstance(item, Chunk):
                piece = delta(*splitter.push(item.text))
                if piece or (item.tokens and self.want_logprobs):
                    yield chunk(piece, self._logprobs(item.tokens))
            elif isinstance(item, Done):
                last = delta(*splitter.flush(), end=True)  # first: it may announce a last call
                yield chunk(last, finish=self._finish(item.finish_reason, tools.calls if tools else 0))
                yield item
