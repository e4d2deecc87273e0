"""A demanded tool call in the form the chat template uses: with a Qwen3.5-style template (calls as
``<function=NAME>`` XML) the grammar is the XML form's, checked here on sample strings with
llguidance's own matcher, and a live ``phalanx serve`` (TP 2, CPU, tiny random model) answers
``tool_choice: required`` and a named function with parsed ``tool_calls``, whole and streamed,
also when the prompt opens the model's reasoning (the call then follows ``</think>``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llguidance
import openai
import pytest

from phalanx.models.tiny import CHAT_TEMPLATE
from phalanx.server.chat_template import ChatTemplate
from phalanx.server.detokenizer import TextTokenizer
from phalanx.server.errors import ApiError
from phalanx.server.structured import GrammarCheck, after_reasoning, response_format_grammar
from phalanx.server.tool_calls import ToolCallParser
from phalanx.server.xml_call_grammar import xml_tool_call_grammar
from tests.support.live_server import MODEL_NAME, live_server

# Qwen3.5's template in small: tools listed as JSON, the XML call form shown and past calls written so
QWEN35_LIKE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a function reply:\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for key, value in call.function.arguments | items %}"
    "{{- '<parameter=' + key + '>\\n' + (value | string) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
BOUNDED = {  # values a random model cannot draw out past max_tokens
    "city": {"type": "string", "enum": ["Paris", "London"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "sunny": {"type": "boolean"},
}


def _weather(properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": ["city", "days", "sunny"]}
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


WEATHER = _weather(BOUNDED)
NOTED = _weather({**BOUNDED, "note": {"type": "string"}})  # an optional raw-text parameter
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
ANY = {"type": "function", "function": {"name": "log"}}
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=sunny>\ntrue\n</parameter>\n"
    "<parameter=note>\ntwo\nlines </para\n</parameter>\n</function>\n</tool_call>"
)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def check(tiny_model_dir: Path) -> GrammarCheck:
    return GrammarCheck(tiny_model_dir, 512, (2,))


def _accepts(check: GrammarCheck, grammar: str, text: str | list[int]) -> bool:
    ids = check.tokenizer.tokenize_str(text) if isinstance(text, str) else text
    matcher = llguidance.LLMatcher(check.tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_the_template_decides_the_form() -> None:
    assert ChatTemplate(QWEN35_LIKE).writes_xml_calls
    assert not ChatTemplate(CHAT_TEMPLATE).writes_xml_calls


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        (CALL, True),
        (CALL.replace("<parameter=note>\ntwo\nlines </para\n</parameter>\n", ""), True),  # optional
        (CALL.replace("get_weather", "get_wether"), False),  # not an offered tool
        (CALL.replace("<parameter=days>\n3\n</parameter>\n", ""), False),  # a required one missing
        (CALL.replace("Paris", "Rome"), False),  # not in the enum
        (CALL.replace("\n3\n", "\nthree\n"), False),  # an integer's value is JSON
        (CALL.replace("\n3\n", "\n9\n"), False),  # above its maximum
        (CALL.replace("\ntrue\n", "\nyes\n"), False),
        (CALL.replace("lines </para", "lines </parameter> more"), False),  # text cannot hold its tag
        (CALL.replace("</function>\n</tool_call>", "</function></tool_call>"), False),  # the layout
        (CALL.replace("<tool_call>\n", "<tool_call>\n{"), False),
    ],
)
def test_the_xml_grammar_accepts_only_a_well_formed_call(
    check: GrammarCheck, text: str, accepted: bool
) -> None:
    grammar = xml_tool_call_grammar([NOTED, TIME], ["get_weather"], check)
    assert _accepts(check, grammar, text) is accepted


def test_what_the_grammar_accepts_the_parser_reads_as_typed_arguments() -> None:
    content, deltas = ToolCallParser(tools=[NOTED]).push(CALL, end=True)
    assert content == "" and [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather"]
    arguments = json.loads("".join(d["function"]["arguments"] for d in deltas))
    assert arguments == {"city": "Paris", "days": 3, "sunny": True, "note": "two\nlines </para"}


def test_a_tool_without_properties_takes_any_parameters_as_text(check: GrammarCheck) -> None:
    grammar = xml_tool_call_grammar([NOTED, ANY], ["get_weather", "log"], check)
    bare = "<tool_call>\n<function=log>\n</function>\n</tool_call>"
    assert _accepts(check, grammar, bare)
    assert _accepts(
        check, grammar, bare.replace("</function>", "<parameter=zone x>\nUTC\n</parameter>\n</function>")
    )
    assert _accepts(check, grammar, CALL)
    only_log = xml_tool_call_grammar([NOTED, ANY], ["log"], check)
    assert _accepts(check, only_log, bare) and not _accepts(check, only_log, CALL)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"properties": {"a>b": {}}},
            "tools: the parameter name 'a>b' cannot be written in the model's XML tool-call form"
            " (no '<', '>' or newline, a tag of at most 1024 characters)",
        ),
        (
            {"properties": {"k" * 1013: {}}},
            f"tools: the parameter name {'k' * 64!r} cannot be written in the model's XML tool-call"
            " form (no '<', '>' or newline, a tag of at most 1024 characters)",
        ),
        ("x", "tools: the parameters of 'f' are not a JSON schema object with object properties"),
        (
            {"properties": [1]},
            "tools: the parameters of 'f' are not a JSON schema object with object properties",
        ),
    ],
)
def test_parameters_the_form_cannot_write_are_a_400(
    check: GrammarCheck, parameters: Any, message: str
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(ApiError) as raised:
        xml_tool_call_grammar([tool], ["f"], check)
    assert (raised.value.status, raised.value.param, raised.value.message) == (400, "tools", message)


def test_behind_reasoning_the_constraint_holds_from_its_end_on(check: GrammarCheck) -> None:
    calls = after_reasoning(xml_tool_call_grammar([NOTED], ["get_weather"], check), "tools", check)
    think_end = check.special_token("</think>")  # the tiny vocabulary has it as a special token
    assert think_end is not None and check.special_token("<tool_call>") is None
    assert (check.tag("</think>"), check.tag("<tool_call>")) == (
        f'("</think>" | <[{think_end}]>)',
        '"<tool_call>"',
    )
    assert _accepts(check, calls, "Paris, I think. </thin\n</think>\n\n" + CALL)  # the tag as text
    thoughts, rest = check.tokenizer.tokenize_str("hmm"), check.tokenizer.tokenize_str("\n\n" + CALL)
    assert _accepts(check, calls, [*thoughts, think_end, *rest])  # or as its token
    assert not _accepts(check, calls, CALL)  # the reasoning must end first
    assert not _accepts(check, calls, "hmm</think>\n\n<tool_call>\n<function=get_time>")
    json_object = after_reasoning(
        response_format_grammar({"type": "json_object"}, check), "response_format", check
    )
    assert _accepts(check, json_object, 'x</think>\n\n{"a":1}')
    assert not _accepts(check, json_object, "x</think>\n\nno")


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("xml_tools_server")
    (root / "template.jinja").write_text(QWEN35_LIKE)
    with live_server(
        tiny_model_dir, root / "server.log", "--chat-template", str(root / "template.jinja")
    ) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_weather(name: str, arguments: str) -> None:
    assert name == "get_weather"
    args: dict[str, Any] = json.loads(arguments)
    assert args["city"] in ("Paris", "London") and args["days"] in range(1, 8)
    assert isinstance(args["sunny"], bool)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_demanded_call_comes_back_as_tool_calls(client: openai.OpenAI, tool_choice: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=200, tools=[WEATHER], tool_choice=tool_choice, seed=1
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_weather(call.function.name, call.function.arguments)
    assert not choice.message.content


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_demanded_call_streams_as_delta_tool_calls(client: openai.OpenAI, tool_choice: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=200,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        seed=2,
        stream=True,
    )
    deltas, finish, content = [], None, ""
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and {d.index for d in deltas} == {0} and not content
    name, arguments = deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas)
    if name == "get_time" and tool_choice == "required":
        assert json.loads(arguments)["zone"] in ("UTC", "CET")
    else:
        _check_weather(name, arguments)


def test_a_demanded_call_follows_the_reasoning(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    """The prompt ends in ``<think>``; the tiny model is pushed to end its reasoning at once."""
    think_end = TextTokenizer.from_model_dir(tiny_model_dir).encode("</think>", add_special_tokens=False)
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=200,
        tools=[WEATHER],
        tool_choice="required",
        logit_bias={str(think_end[0]): 100},
        seed=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_weather(call.function.name, call.function.arguments)
    assert not choice.message.content
