"""The Lark grammar of one tool call in Qwen3.5's XML form, as its chat template writes it:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

``NAME`` is one of the tools allowed. The parameters are the tool's declared properties in their
declared order, the required ones present and each optional one at most once. A value follows its
property's schema as the parser reads it back (``server.tool_call_xml``): a string (or a property
without a type, or one that may be a string) is raw text up to the closing tag, one of its ``enum``
or ``const`` values when it has them; any other type is compact JSON following the property's
schema. A tool that declares no properties (and does not forbid others) takes any parameters as
raw text.
"""

from __future__ import annotations

import json
from typing import Any

from phalanx.server.errors import bad_request
from phalanx.server.structured import (
    JSON_OPTIONS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    GrammarCheck,
    json_schema_grammar,
    text_up_to,
)
from phalanx.server.tool_call_xml import (
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    MAX_TAG,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
)

RAW_VALUE = text_up_to(PARAMETER_CLOSE, lead="\\n")  # a text value: no tag inside, a newline before it
# a parameter name the parser can read back (its tag within MAX_TAG characters)
ANY_KEY = f"/[^<>\\n]{{1,{MAX_TAG - len(PARAMETER_OPEN) - 1}}}/"
_NOT_IN_NAMES = "<>\n"


def _literal(text: str) -> str:
    return json.dumps(text)


NEWLINE = _literal("\n")
KEY_END = _literal(">\n")
CLOSE_VALUE = _literal("\n" + PARAMETER_CLOSE)  # what ends a value that is not raw text


def _is_text(spec: dict[str, Any]) -> bool:
    """Whether the parser keeps this property's value as text (``tool_call_xml.XmlCall._typed``)."""
    kind = spec.get("type")
    return kind in (None, "string") or (isinstance(kind, list) and "string" in kind)


def _text_value(spec: dict[str, Any]) -> str:
    """Raw text, or one of the fixed strings the schema allows, each closed by its tag."""
    choices = [spec["const"]] if "const" in spec else spec.get("enum")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(_literal(c) for c in choices) + f") {CLOSE_VALUE}"
    return "RAW_VALUE"


def _json_value(spec: dict[str, Any], definitions: dict[str, Any]) -> str:
    # definitions travel with the property so that its "#/$defs/..." references still resolve
    schema = {**spec, **definitions, "x-guidance": JSON_OPTIONS}
    return f"%json {json.dumps(schema)} {CLOSE_VALUE}"


def _tag(opening: str, name: str, what: str) -> str:
    """``opening`` + ``name`` + ``>``, refused when the parser could not read it back."""
    tag = f"{opening}{name}>"
    if any(char in name for char in _NOT_IN_NAMES) or len(tag) > MAX_TAG:
        raise bad_request(
            f"tools: {what} {name[:64]!r} cannot be written in the model's XML tool-call form"
            f" (no '<', '>' or newline, a tag of at most {MAX_TAG} characters)",
            param="tools",
        )
    return tag


def _call_rules(rule: str, function: dict[str, Any], check: GrammarCheck) -> list[str]:
    """The rules of one tool's call: ``rule`` and its parameters' rules."""
    name = function["name"]
    head = _literal(_tag(FUNCTION_OPEN, name, "the tool name") + "\n")
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {} if isinstance(parameters, dict) else None
    if not isinstance(properties, dict):
        raise bad_request(
            f"tools: the parameters of {name!r} are not a JSON schema object with object properties",
            param="tools",
        )
    json_schema_grammar(parameters, "tools", check)  # a malformed schema is a 400, as in the JSON form
    required = set(parameters.get("required") or ())
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    tail = _literal(FUNCTION_CLOSE + "\n")
    if not properties and parameters.get("additionalProperties") is not False:
        any_key = f"{_literal(PARAMETER_OPEN)} {ANY_KEY} {KEY_END}"
        return [f"{rule}: {head} {rule}_any* {tail}", f"{rule}_any: {any_key} RAW_VALUE {NEWLINE}"]
    rules, body = [], []
    for index, (key, spec) in enumerate(properties.items()):
        spec = spec if isinstance(spec, dict) else {}
        opening = _literal(_tag(PARAMETER_OPEN, key, "the parameter name") + "\n")
        value = _text_value(spec) if _is_text(spec) else _json_value(spec, definitions)
        rules.append(f"{rule}_{index}: {opening} {value} {NEWLINE}")
        body.append(f"{rule}_{index}" + ("" if key in required else "?"))
    return [f"{rule}: {head} {' '.join(body)} {tail}", *rules]


def xml_tool_call_grammar(tools: list[dict[str, Any]], names: list[str], check: GrammarCheck) -> str:
    """One ``<tool_call>`` block calling one of ``names`` (offered in ``tools``), in the XML form."""
    offered = [tool["function"] for tool in tools if tool["function"]["name"] in names]
    rules: list[str] = []
    for index, function in enumerate(offered):
        rules += _call_rules(f"call_{index}", function, check)
    calls = " | ".join(f"call_{index}" for index in range(len(offered)))
    start = f"start: {check.tag(TOOL_CALL_OPEN)} {NEWLINE} ({calls}) {check.tag(TOOL_CALL_CLOSE)}"
    return check("\n".join([start, *rules, f"RAW_VALUE: {RAW_VALUE}"]) + "\n", "tools")
