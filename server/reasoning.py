"""Splitting a thinking model's output into ``reasoning_content`` and ``content``.

The text between ``<think>`` and ``</think>`` is reasoning. Qwen3.5's chat template already ends
the prompt with ``<think>\\n``, so generation then starts inside the reasoning. A tag split across
stream deltas is held back until it is complete.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self._in_reasoning = starts_in_reasoning
        self._seen_end = False  # one reasoning block per reply: later tags are content
        self._strip_newlines = False  # the blank line after </think> is layout, not content
        self._pending = ""

    @staticmethod
    def prompt_opens_reasoning(prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK_START)

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) text to emit after ``delta``."""
        text = self._pending + delta
        self._pending = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._in_reasoning:
                end = text.find(THINK_END)
                if end < 0:
                    text = self._hold_back(text, THINK_END, reasoning)
                    break
                reasoning.append(text[:end])
                text = text[end + len(THINK_END) :]
                self._in_reasoning, self._seen_end, self._strip_newlines = False, True, True
                continue
            if self._strip_newlines:
                text = text.lstrip("\n")
                self._strip_newlines = not text
                continue
            start = -1 if self._seen_end else text.find(THINK_START)
            if start < 0:
                text = self._hold_back(text, None if self._seen_end else THINK_START, content)
                break
            content.append(text[:start])
            text = text[start + len(THINK_START) :]
            self._in_reasoning = True
        return "".join(reasoning), "".join(content)

    def _hold_back(self, text: str, tag: str | None, out: list[str]) -> str:
        keep = _partial_tag_suffix(text, tag) if tag else 0
        out.append(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return ""

    def flush(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        return (pending, "") if self._in_reasoning else ("", pending)
