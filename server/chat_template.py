"""The model's chat template, rendered as transformers' ``apply_chat_template`` renders it.

The template comes from ``tokenizer_config.json`` (or a ``chat_template.jinja`` beside it) and runs
in jinja2's immutable sandbox: a template is data shipped with a checkpoint, not trusted code.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from phalanx.server.tool_call_xml import template_writes_xml_calls


class ChatTemplateError(ValueError):
    """The template is missing, or rendering it failed (including the template's own raise_exception)."""


class _GenerationBlock(Extension):
    """``{% generation %}…{% endgeneration %}``: transformers marks assistant text with it (for
    training masks); rendering a prompt just keeps the block's text."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # transformers' tojson keeps non-ASCII text readable (jinja's built-in escapes it for HTML)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _override_source(override: str) -> str:
    """``--chat-template``: the argument itself when it is a template, else a file's text."""
    if "{{" in override or "{%" in override:
        return override
    path = Path(override)
    if not path.is_file():
        raise ChatTemplateError(f"chat template {override!r} is neither a file nor a jinja template")
    return path.read_text(encoding="utf-8")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.writes_xml_calls = template_writes_xml_calls(source)  # the form a demanded call takes
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate:
        """The checkpoint's template, or ``override`` (a template file, or the template itself)."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        source = config.get("chat_template") if override is None else _override_source(override)
        jinja_file = model_dir / "chat_template.jinja"
        if source is None and jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            by_name = {t["name"]: t["template"] for t in source}
            source = by_name.get("default")
        if not isinstance(source, str):
            raise ChatTemplateError(f"no chat template in {config_path} or {jinja_file}")
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        variables = {
            **template_kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
