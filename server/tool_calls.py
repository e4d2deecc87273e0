"""Tool calls in a reply, as Qwen writes them: ``<tool_call>`` blocks, each holding one JSON object
``{"name": ..., "arguments": {...}}``, turned into OpenAI's ``tool_calls``. A block whose JSON does
not parse stays in the text, as vLLM's parser leaves it."""

from __future__ import annotations

import json
import uuid
from typing import Any

from phalanx.server.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def _call(block: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": parsed["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolCallSplitter:
    """Splits text into plain content and tool calls as it arrives: text that may open a block is
    held back until the block closes (or cannot be one)."""

    def __init__(self) -> None:
        self._held = ""
        self.calls: list[dict[str, Any]] = []

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content safe to show, tool calls completed by ``text``)."""
        self._held += text
        content, calls = [], []
        while True:
            start = self._held.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _partial_open(self._held)
                content.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            content.append(self._held[:start])
            end = self._held.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                self._held = self._held[start:]
                break
            block = self._held[start : end + len(TOOL_CALL_CLOSE)]
            self._held = self._held[end + len(TOOL_CALL_CLOSE) :]
            call = _call(block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)].strip())
            if call is None:
                content.append(block)
            else:
                calls.append(call)
        self.calls += calls
        return "".join(content), calls

    def flush(self) -> str:
        """Held text at the end (an unclosed block is content)."""
        held, self._held = self._held, ""
        return held


def _partial_open(text: str) -> int:
    """How many trailing characters of ``text`` could start a ``<tool_call>`` tag."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
