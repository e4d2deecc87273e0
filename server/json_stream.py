"""One JSON object read a character at a time, as a model writes it: each character is checked at
once (a syntax error is raised at the first character that cannot continue the object) and given
back re-written as ``json.dumps(..., ensure_ascii=False)`` writes the parsed value (``", "`` and
``": "`` between items, no other whitespace, numbers and escapes in their canonical form), so the
pieces of a streamed value join into the same text a whole parse gives. A lone UTF-16 surrogate
stays an escape, which keeps the text encodable as UTF-8.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Literal

WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_SCALAR_START = set("-0123456789tfn")
_SCALAR_CHARS = set("+-.0123456789eEtruefalsn")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = set("0123456789abcdefABCDEF")

Kind = Literal["key", "value", "punct"]
# a piece of the re-written text: (containers around it, what it is, text); a container's own
# brackets lie in the container around it
Piece = tuple[int, Kind, str]


class JsonSyntaxError(ValueError):
    """The character cannot continue a JSON object; ``pieces``: what it completed before that (a
    number it ended)."""

    def __init__(self, message: str, pieces: list[Piece] | None = None) -> None:
        super().__init__(message)
        self.pieces = pieces or []


@functools.lru_cache(maxsize=4096)
def _encode(char: str) -> str:
    if "\ud800" <= char <= "\udfff":
        return f"\\u{ord(char):04x}"
    return json.dumps(char, ensure_ascii=False)[1:-1]


class JsonObjectStream:
    def __init__(self) -> None:
        self._stack: list[str] = []  # the open containers' brackets
        # what may come next: value, value_or_end ("]"), key, key_or_end ("}"), colon, next (","
        # or the container's end), done
        self._expect = "value"
        self._string: Kind | None = None  # inside a key's or a value's string
        self._escape: str | None = None  # an escape's characters after the backslash
        self._high: int | None = None  # a high surrogate escape waiting for its low half
        self._scalar = ""  # a number or literal read so far

    @property
    def done(self) -> bool:
        return self._expect == "done"

    def feed(self, char: str) -> list[Piece]:
        if self._string is not None:
            return self._string_char(char, self._string)
        pieces: list[Piece] = []
        if self._scalar:
            if char in _SCALAR_CHARS:
                self._scalar += char
                return pieces
            pieces.append(self._end_scalar())
        if char in WHITESPACE:
            return pieces
        try:
            return pieces + self._structural(char)
        except JsonSyntaxError as e:
            raise JsonSyntaxError(str(e), pieces) from None

    def end(self) -> list[Piece]:
        """The text ends here: a number or literal read so far, if it is one."""
        token = self._scalar
        if token in _LITERALS or _NUMBER.fullmatch(token):
            return [self._end_scalar()]
        return []

    def _structural(self, char: str) -> list[Piece]:
        depth, expect = len(self._stack), self._expect
        wants_value = expect in ("value", "value_or_end")
        if wants_value and depth == 0 and char != "{":
            raise JsonSyntaxError(f"{char!r} does not start an object")
        if char == '"' and (wants_value or expect in ("key", "key_or_end")):
            self._string = "value" if wants_value else "key"
            return [(depth, self._string, '"')]
        if char in "{[" and wants_value:
            self._stack.append(char)
            self._expect = "key_or_end" if char == "{" else "value_or_end"
            return [(depth, "value", char)]
        closes = {"}": ("{", "key_or_end"), "]": ("[", "value_or_end")}.get(char)
        if closes is not None and self._stack[-1:] == [closes[0]] and expect in ("next", closes[1]):
            self._stack.pop()
            self._after_value()
            return [(depth - 1, "value", char)]
        if char == ":" and expect == "colon":
            self._expect = "value"
            return [(depth, "punct", ": ")]
        if char == "," and expect == "next":
            self._expect = "key" if self._stack[-1] == "{" else "value"
            return [(depth, "punct", ", ")]
        if char in _SCALAR_START and wants_value:
            self._scalar = char
            return []
        raise JsonSyntaxError(f"unexpected {char!r}")

    def _after_value(self) -> None:
        self._expect = "next" if self._stack else "done"

    def _end_scalar(self) -> Piece:
        token, self._scalar = self._scalar, ""
        if token in _LITERALS:
            text = token
        elif _NUMBER.fullmatch(token):
            text = json.dumps(json.loads(token))
        else:
            raise JsonSyntaxError(f"{token!r} is not a number or literal")
        self._after_value()
        return (len(self._stack), "value", text)

    def _string_char(self, char: str, kind: Kind) -> list[Piece]:
        if self._escape is not None:
            return self._escaped(char, kind)
        if char == "\\":
            self._escape = ""
            return []
        if char == '"':
            self._string = None
            pieces = [*self._lone_high(kind), (len(self._stack), kind, '"')]
            if kind == "key":
                self._expect = "colon"
            else:
                self._after_value()
            return pieces
        if char < " ":
            raise JsonSyntaxError(f"unescaped control character {char!r} in a string")
        return self._text(ord(char), kind)

    def _escaped(self, char: str, kind: Kind) -> list[Piece]:
        self._escape = (self._escape or "") + char
        if self._escape[0] == "u":
            if char not in _HEX and len(self._escape) > 1:
                raise JsonSyntaxError(f"bad \\u escape {self._escape!r}")
            if len(self._escape) < 5:
                return []
            unit, self._escape = int(self._escape[1:], 16), None
            return self._text(unit, kind)
        escaped, self._escape = _ESCAPES.get(char), None
        if escaped is None:
            raise JsonSyntaxError(f"bad escape \\{char}")
        return self._text(ord(escaped), kind)

    def _text(self, unit: int, kind: Kind) -> list[Piece]:
        """A decoded UTF-16 unit (or code point) of the string, re-written."""
        if self._high is not None and 0xDC00 <= unit <= 0xDFFF:
            char = chr(0x10000 + ((self._high - 0xD800) << 10) + (unit - 0xDC00))
            self._high = None
            return [(len(self._stack), kind, _encode(char))]
        pieces = self._lone_high(kind)
        if 0xD800 <= unit <= 0xDBFF:
            self._high = unit
            return pieces
        return [*pieces, (len(self._stack), kind, _encode(chr(unit)))]

    def _lone_high(self, kind: Kind) -> list[Piece]:
        if self._high is None:
            return []
        high, self._high = self._high, None
        return [(len(self._stack), kind, _encode(chr(high)))]
