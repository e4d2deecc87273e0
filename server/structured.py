"""Structured output: the request fields that constrain a reply, as one llguidance grammar.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json``,
``guided_regex`` and ``guided_choice``, and a ``tool_choice`` that demands a tool call
(``required`` or a named function: one Qwen-style ``<tool_call>`` block whose JSON names an offered
tool and follows its parameters). Rank 0 masks every token the grammar does not allow
(``worker/grammar.py``). A grammar that does not compile is a 400 naming the field it came from.
When the prompt opens the model's reasoning, the constraint holds from the reasoning's end on,
as vLLM applies it behind a reasoning parser: free text up to ``</think>``, the blank line the
template writes after it, then the constrained output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import llguidance

from phalanx.server.errors import bad_request
from phalanx.server.reasoning import THINK_END

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# compact JSON: free whitespace would let a model pad its reply with blank lines until max_tokens
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def _lark_regex(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/``."""
    return re.escape(text).replace("/", "\\/")


def text_up_to(tag: str, lead: str = "") -> str:
    """A Lark terminal: any text up to the first ``tag`` (which the regex ``lead`` must precede),
    the tag included. One terminal, since llguidance's lexer is greedy: a terminal of the text
    alone would read on past the tag. The ``&`` and ``~`` operators are llguidance's own."""
    escaped = _lark_regex(tag)
    return f"/(?s:.*){lead}{escaped}/ & ~/(?s:.*){escaped}(?s:.+)/"


class GrammarCheck:
    """Compiles grammars against the model's tokenizer, as rank 0 will (built on first use)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_file = Path(model_dir) / "tokenizer.json"
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    def __call__(self, grammar: str, field: str) -> str:
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise bad_request(f"{field}: {error.strip()}", param=field)
        return grammar

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            json_text = self._tokenizer_file.read_text(encoding="utf-8")
            self._tokenizer = llguidance.LLTokenizer(json_text, n_vocab=self._vocab_size, eos_token=self._eos)
        return self._tokenizer

    def special_token(self, text: str) -> int | None:
        """The id of the special token that is ``text``, if the vocabulary has one (a grammar
        matches a special token only by its id, never by its text)."""
        ids = self.tokenizer.tokenize_str(text)
        return ids[0] if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]) else None

    def tag(self, text: str) -> str:
        """A Lark item for a tag such as ``<tool_call>``: its text, or its special token where the
        vocabulary has one (so the model may write it as it was trained to)."""
        special = self.special_token(text)
        return json.dumps(text) if special is None else f"({json.dumps(text)} | <[{special}]>)"


def json_schema_grammar(schema: Any, field: str, check: GrammarCheck) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise bad_request(f"{field}: the schema is not valid JSON: {e}", param=field) from e
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{field}: a JSON schema is an object, got {type(schema).__name__}", param=field)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise bad_request(f"{field}: {e}", param=field) from e
    return check(grammar, field)


def response_format_grammar(response_format: dict[str, Any], check: GrammarCheck) -> str | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format", check)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format: json_schema needs a json_schema.schema", param="response_format"
            )
        return json_schema_grammar(spec["schema"], "response_format", check)
    raise bad_request(
        f"response_format: type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def guided_grammar(
    guided_json: Any, guided_regex: str | None, guided_choice: list[str] | None, check: GrammarCheck
) -> str | None:
    if guided_json is not None:
        return json_schema_grammar(guided_json, "guided_json", check)
    if guided_regex is not None:
        return check(llguidance.LLMatcher.grammar_from_regex(guided_regex), "guided_regex")
    if guided_choice is not None:
        if not guided_choice:
            raise bad_request("guided_choice: at least one choice is needed", param="guided_choice")
        return check(
            llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in guided_choice)),
            "guided_choice",
        )
    return None


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"tools.{index}: a tool is {{type: function, function: {{name, ...}}}}", param="tools"
            )
        names.append(function["name"])
    return names


def tool_call_grammar(tools: list[dict[str, Any]], names: list[str], check: GrammarCheck) -> str:
    """One ``<tool_call>`` block calling one of ``names`` with arguments that follow its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
        if tool["function"]["name"] in names
    ]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
    lark = f'start: {check.tag(TOOL_CALL_OPEN)} "\\n" call "\\n" {check.tag(TOOL_CALL_CLOSE)}\n'
    return check(
        llguidance.LLMatcher.grammar_from_lark(lark + f"call: %json {json.dumps(schema)}\n"), "tools"
    )


def after_reasoning(grammar: str, field: str, check: GrammarCheck) -> str:
    """``grammar`` behind the reasoning: any text up to ``</think>`` (as text, or as the special
    token when the vocabulary has one), a blank line, then the output ``grammar`` allows (held in
    the same top-level grammar, which names it)."""
    inner = (
        json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    )
    first = inner["grammars"][0]
    first["name"] = first.get("name") or "constrained"
    rules = [f'start: reasoning "\\n\\n" @{first["name"]}', f"REASONING: {text_up_to(THINK_END)}"]
    special = check.special_token(THINK_END)
    if special is None:
        rules.append("reasoning: REASONING")
    else:  # text that never holds the tag, then the tag's token
        rules.append(f"reasoning: REASONING | THOUGHTS <[{special}]>")
        rules.append(f"THOUGHTS: /(?s:.*)/ & ~/(?s:.*){_lark_regex(THINK_END)}(?s:.*)/")
    top = {"grammars": [{"name": "reasoning", "lark_grammar": "\n".join(rules) + "\n"}, *inner["grammars"]]}
    return check(json.dumps(top), field)
