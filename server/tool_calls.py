"""Tool calls in a reply, as Qwen writes them: ``<tool_call>`` blocks, each holding one call, either
Qwen3.5's ``<function=NAME>`` form (``server.tool_call_xml``) or Qwen3's JSON object
``{"name": ..., "arguments": {...}}``, turned into OpenAI's ``tool_calls`` as the text arrives.

A block's call is announced (``id``, ``type``, ``function.name``) once the block has given the
name, and its ``arguments`` then follow in pieces as they arrive, re-written as ``json.dumps``
writes the parsed object (``server.json_stream``), so the pieces join into the arguments a whole
reply gets. A block that breaks before its name is known (neither form, no string ``name``, the
reply ends) stays in the text as written, as vLLM's parser leaves it. A call already announced
cannot be taken back: if its block breaks later, the call keeps the arguments sent so far and the
rest of the block is dropped. Whole replies go through the same parser, so they get the same calls
as streamed ones.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from phalanx.server.json_stream import WHITESPACE, JsonObjectStream, JsonSyntaxError
from phalanx.server.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from phalanx.server.tool_call_xml import XmlCall, XmlCallSyntaxError, parameter_types

_NAME_KEY = json.dumps("name")
_ARGUMENTS_KEY = json.dumps("arguments")


@dataclass
class _Block:
    """One ``<tool_call>`` block as it arrives: a JSON object (Qwen3) or, when it starts with
    ``<``, Qwen3.5's ``<function=...>`` form (``server.tool_call_xml``)."""

    types: dict[str, dict[str, Any]]  # the offered tools' parameter types, for the XML form
    raw: list[str] = field(default_factory=lambda: [TOOL_CALL_OPEN])  # as written, tags included
    name: str | None = None
    arguments: list[str] | None = None  # pieces of the arguments' JSON, re-written
    broken: bool = False
    _json: JsonObjectStream = field(default_factory=JsonObjectStream)
    _key_pieces: list[str] = field(default_factory=list)  # a top-level key being read, re-written
    _key: str = ""  # the current top-level key, re-written
    _value: list[str] = field(default_factory=list)  # the current top-level value, if the name
    _in_arguments: bool = False
    _closing: int = 0  # characters of the closing tag matched after the object
    _tail: str = ""  # once broken: the last characters, to find the closing tag
    _started: bool = False  # a character other than whitespace came
    _xml: XmlCall | None = None

    @property
    def complete(self) -> bool:
        """The call closed (whatever followed it inside the block)."""
        return self._xml.done if self._xml is not None else self._json.done

    def feed(self, text: str) -> int | None:
        """Reads ``text``; if the block ends in it, how many of its characters the block took."""
        for i, char in enumerate(text):
            self.raw.append(char)
            if self.broken:
                self._tail = (self._tail + char)[-len(TOOL_CALL_CLOSE) :]
                if self._tail == TOOL_CALL_CLOSE:
                    return i + 1
            elif self.complete:
                if self._closing == 0 and char in WHITESPACE:
                    continue
                if TOOL_CALL_CLOSE[self._closing] != char:
                    self._break(self._closing + 1)
                    continue
                self._closing += 1
                if self._closing == len(TOOL_CALL_CLOSE):
                    return i + 1
            elif self._xml is not None or (char == "<" and not self._started):
                self._feed_xml(char)
            else:
                self._started = self._started or char not in WHITESPACE
                try:
                    for depth, kind, piece in self._json.feed(char):
                        self._take(depth, kind, piece)
                except JsonSyntaxError as e:
                    for piece in e.pieces:
                        self._take(*piece)
                    self._break(1)
        return None

    def _feed_xml(self, char: str) -> None:
        if self._xml is None:
            self._xml, self._started = XmlCall(self.types), True
            self.arguments = self._xml.arguments
        try:
            self._xml.feed(char)
        except XmlCallSyntaxError:
            self._break(1)
        if self.name is None and self._xml.name is not None and _encodable(self._xml.name):
            self.name = self._xml.name

    def end(self) -> None:
        """The reply ends inside the block: a number it was writing is taken as it stands."""
        if not self.broken and self._xml is None:
            for piece in self._json.end():
                self._take(*piece)

    def _break(self, last: int) -> None:
        """The call cannot go on; the closing tag is looked for from the ``last`` characters on."""
        self.broken = True
        self._tail = "".join(self.raw[-last:])

    def _take(self, depth: int, kind: str, piece: str) -> None:
        if depth == 0:  # the object's own braces; the closing one ends the last value
            if piece == "}":
                self._end_value()
        elif depth == 1 and kind == "key":
            self._key_pieces.append(piece)
        elif depth == 1 and kind == "punct":
            if piece == ", ":
                self._end_value()
            else:  # ": " ends the key
                self._key, self._key_pieces = "".join(self._key_pieces), []
        elif self._key == _NAME_KEY:
            self._value.append(piece)
            if depth == 1 and piece == '"' and len(self._value) > 1:  # the name's closing quote
                self._take_name()
        elif self._in_arguments or (self.arguments is None and self._key == _ARGUMENTS_KEY):
            self._in_arguments = True
            self.arguments = self.arguments or []
            self.arguments.append(piece)

    def _take_name(self) -> None:
        name = json.loads("".join(self._value))
        if self.name is None and isinstance(name, str) and _encodable(name):
            self.name = name

    def _end_value(self) -> None:
        self._key, self._value, self._in_arguments = "", [], False


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ToolCallParser:
    """Splits a reply's text into content and ``delta.tool_calls`` entries as it arrives: text that
    may open a block is held back until it cannot; a block's text until its name is known."""

    def __init__(self, max_calls: int | None = None, tools: list[dict[str, Any]] | None = None) -> None:
        self._types = parameter_types(tools)
        self._held = ""  # outside a block: a tail that may start the opening tag
        self._block: _Block | None = None
        self._max_calls = max_calls  # later calls are read and dropped (parallel_tool_calls false)
        self._index: int | None = None  # the current block's call, once announced
        self._sent = 0  # pieces of its arguments sent
        self.calls = 0  # calls announced

    def push(self, text: str, end: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to show, tool call deltas: at most one per call, in call order); ``end``: the
        reply ends with ``text``, so what is held is settled (an unclosed block ends there)."""
        content: list[str] = []
        deltas: dict[int, dict[str, Any]] = {}
        while text:
            if self._block is None:
                text = self._outside(text, content)
            else:
                taken = self._block.feed(text)
                self._announce(self._block, deltas)
                if taken is None:
                    break
                text = text[taken:]
                self._end_block(content, deltas)
        if end:
            content.append(self._held)
            self._held = ""
            self._end_block(content, deltas)
        return "".join(content), list(deltas.values())

    def _outside(self, text: str, content: list[str]) -> str:
        text = self._held + text
        start = text.find(TOOL_CALL_OPEN)
        if start < 0:
            keep = _partial_open(text)
            content.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            return ""
        content.append(text[:start])
        self._held = ""
        self._block = _Block(self._types)
        return text[start + len(TOOL_CALL_OPEN) :]

    def _announce(self, block: _Block, deltas: dict[int, dict[str, Any]]) -> None:
        """The block's call once its name is known, then each new piece of its arguments."""
        if block.name is None:
            return
        if self._index is None:
            if self._max_calls is not None and self.calls >= self._max_calls:
                return
            self._index, self._sent = self.calls, 0
            self.calls += 1
            deltas[self._index] = {
                "index": self._index,
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": block.name, "arguments": ""},
            }
        pieces = block.arguments or []
        if len(pieces) > self._sent:
            delta = deltas.setdefault(self._index, {"index": self._index, "function": {"arguments": ""}})
            delta["function"]["arguments"] += "".join(pieces[self._sent :])
            self._sent = len(pieces)

    def _end_block(self, content: list[str], deltas: dict[int, dict[str, Any]]) -> None:
        block, self._block = self._block, None
        if block is None:
            return
        block.end()
        self._announce(block, deltas)
        if self._index is not None:
            if block.complete and block.arguments is None:  # a call without arguments takes none
                block.arguments = ["{}"]
                self._announce(block, deltas)
        elif block.name is None:
            content.append("".join(block.raw))
        self._index = None


def _partial_open(text: str) -> int:
    """How many trailing characters of ``text`` could start a ``<tool_call>`` tag."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def whole_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls a whole reply returns: each call's deltas joined."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta["index"])
        if call is None:
            calls[delta["index"]] = {key: value for key, value in delta.items() if key != "index"}
            calls[delta["index"]]["function"] = dict(delta["function"])
        else:
            call["function"]["arguments"] += delta["function"]["arguments"]
    return list(calls.values())
