"""A tool call as Qwen3.5 writes it inside ``<tool_call>``: ``<function=NAME>``, then each argument
as ``<parameter=KEY>`` VALUE ``</parameter>``, then ``</function>``, read a character at a time.
The arguments are re-written as the JSON object ``json.dumps`` writes, one parameter at a time as
each closes; a value takes the type its tool's schema gives the parameter (text for a string or an
unknown parameter, else the value parsed as JSON, kept as text if it does not parse), as vLLM's
parser for this format does.
"""

from __future__ import annotations

import json
from typing import Any

from phalanx.server.json_stream import WHITESPACE

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
MAX_TAG = 1024  # characters of a tag; a longer one is not a name (OpenAI's names are 64 at most)


def template_writes_xml_calls(template_source: str) -> bool:
    """Whether a chat template asks for calls in this form (Qwen3.5's shows ``<function=`` in its
    instructions and writes past calls so); else a constrained call takes Qwen3's JSON form."""
    return FUNCTION_OPEN in template_source


class XmlCallSyntaxError(ValueError):
    """The character cannot continue the call."""


def parameter_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each offered tool's parameters' JSON schema types, by tool name and parameter."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function")
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(properties, dict)
        ):
            types[function["name"]] = {
                key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)
            }
    return types


def _dumps(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate parsed from an escape stays an escape
        return json.dumps(value)
    return text


class XmlCall:
    def __init__(self, types: dict[str, dict[str, Any]]) -> None:
        self._types = types
        self.name: str | None = None
        self.arguments: list[str] = []  # pieces of the arguments' JSON
        self.done = False
        self._state = "function"  # function, between (parameters), value, done
        self._text = ""  # a tag being read
        self._value: list[str] = []  # a parameter's value being read, to its closing tag
        self._tail = ""  # the value's last characters, to find its closing tag
        self._key = ""

    def feed(self, char: str) -> None:
        if self.done:
            raise XmlCallSyntaxError(f"unexpected {char!r} after {FUNCTION_CLOSE}")
        if self._state == "value":
            self._value.append(char)
            self._tail = (self._tail + char)[-len(PARAMETER_CLOSE) :]
            if self._tail == PARAMETER_CLOSE:
                self._parameter("".join(self._value)[: -len(PARAMETER_CLOSE)])
            return
        if self._state == "between" and not self._text and char in WHITESPACE:
            return
        if len(self._text) >= MAX_TAG:
            raise XmlCallSyntaxError(f"a tag longer than {MAX_TAG} characters")
        self._text += char
        if self._state == "function":
            self._function(char)
        else:
            self._between(char)

    def _function(self, char: str) -> None:
        if len(self._text) <= len(FUNCTION_OPEN):
            if not FUNCTION_OPEN.startswith(self._text):
                raise XmlCallSyntaxError(f"{self._text!r} does not open {FUNCTION_OPEN}")
        elif char == ">":
            name = self._text[len(FUNCTION_OPEN) : -1].strip()
            if not name:
                raise XmlCallSyntaxError("the function has no name")
            self.name, self._state, self._text = name, "between", ""
        elif char in "<\n":
            raise XmlCallSyntaxError(f"{char!r} inside the function's name")

    def _between(self, char: str) -> None:
        text = self._text
        if FUNCTION_CLOSE.startswith(text):
            if text == FUNCTION_CLOSE:
                self.arguments.append("}" if self.arguments else "{}")
                self.done, self._state = True, "done"
            return
        if len(text) <= len(PARAMETER_OPEN):
            if not PARAMETER_OPEN.startswith(text):
                raise XmlCallSyntaxError(f"{text!r} opens neither a parameter nor {FUNCTION_CLOSE}")
        elif char == ">":
            self._key, self._state, self._text = text[len(PARAMETER_OPEN) : -1].strip(), "value", ""
        elif char in "<\n":
            raise XmlCallSyntaxError(f"{char!r} inside a parameter's name")

    def _parameter(self, value: str) -> None:
        # the newlines around a value are layout (the template writes them)
        value = value.removeprefix("\n").removesuffix("\n")
        self.arguments.append(
            ("{" if not self.arguments else ", ") + json.dumps(self._key, ensure_ascii=False) + ": "
        )
        self.arguments.append(_dumps(self._typed(value)))
        self._state, self._value, self._tail = "between", [], ""

    def _typed(self, value: str) -> Any:
        kind = self._types.get(self.name or "", {}).get(self._key)
        if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
