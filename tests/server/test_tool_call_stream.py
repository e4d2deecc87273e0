"""Tool calls streamed as they are written, without a running server: a reply cut into deltas of
any size goes through ``ChatFormat``'s stream (each chunk checked against the ``openai`` client's
types and accumulated by its own stream state) and gives the same content and calls as the whole
reply; the call's name comes first, then its arguments in pieces; malformed blocks stay content.
An assistant's past calls reach the chat template with their arguments as an object."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from pydantic import ValidationError

from phalanx.server.chat_template import ChatTemplate
from phalanx.server.detokenizer import TextTokenizer
from phalanx.server.generation import Chunk, Done
from phalanx.server.json_stream import JsonObjectStream, JsonSyntaxError
from phalanx.server.openai_format import ChatFormat, Collected
from phalanx.server.schemas import ChatCompletionRequest
from phalanx.server.tool_calls import ToolCallParser

WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.50]}}\n</tool_call>'
)
TWO_CALLS = (
    "Let me look. "
    + WEATHER
    + '\n<tool_call>\n{"name":"get_time","arguments":{"zone":"Europe/Paris","note":"a \\"b\\" \\u00e9\\ud83d\\ude00"}}'
    "\n</tool_call>"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_model_dir(tiny_model_dir)


def _format(tokenizer: TextTokenizer, parallel: bool = True) -> ChatFormat:
    return ChatFormat(
        tokenizer, "tiny", want_logprobs=False, parses_tool_calls=True, parallel_tool_calls=parallel
    )


async def _replay(pieces: list[str]) -> AsyncIterator[Chunk | Done]:
    for piece in pieces:
        yield Chunk(piece)
    yield Done("stop", 5, len(pieces))


def _stream(fmt: ChatFormat, text: str, step: int) -> list[ChatCompletionChunk]:
    pieces = [text[i : i + step] for i in range(0, len(text), step)]

    async def run() -> list[dict[str, Any]]:
        return [c async for c in fmt.stream_choice(0, [1], _replay(pieces)) if not isinstance(c, Done)]  # type: ignore[arg-type]

    return [
        ChatCompletionChunk.model_validate(fmt.envelope(fmt.chunk_object, [choice]))
        for choice in asyncio.run(run())
    ]


def _whole(fmt: ChatFormat, text: str) -> dict[str, Any]:
    return fmt.choice(0, [1], Collected(text, [], Done("stop", 5, 9)))


def _accumulated(chunks: list[ChatCompletionChunk]) -> Any:
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("step", [1, 2, 5, 17, 10_000])
def test_a_streamed_reply_accumulates_to_the_whole_replys_calls(tokenizer: TextTokenizer, step: int) -> None:
    fmt = _format(tokenizer)
    whole = _whole(fmt, TWO_CALLS)
    streamed = _accumulated(_stream(fmt, TWO_CALLS, step))
    assert streamed.finish_reason == whole["finish_reason"] == "tool_calls"
    assert streamed.message.content == whole["message"]["content"] == "Let me look. \n"
    calls = [(c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
    whole_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    assert [call[1:] for call in calls] == whole_calls
    assert [json.loads(arguments) for _, arguments in whole_calls] == [
        {"city": "Paris", "days": [1, 2.5]},
        {"zone": "Europe/Paris", "note": 'a "b" é\U0001f600'},
    ]
    # the arguments string is what json.dumps writes for the parsed arguments
    assert whole_calls[1][1] == json.dumps(json.loads(whole_calls[1][1]), ensure_ascii=False)
    assert len({call[0] for call in calls}) == 2 and all(call[0].startswith("call_") for call in calls)


def test_the_name_comes_first_then_the_arguments_in_pieces(tokenizer: TextTokenizer) -> None:
    chunks = _stream(_format(tokenizer), TWO_CALLS, 3)
    deltas = [(chunk.choices[0].delta, chunk.choices[0].finish_reason) for chunk in chunks]
    content_at = next(i for i, (d, _) in enumerate(deltas) if d.content == "Let me look. "[:3])
    calls = [(i, call) for i, (d, _) in enumerate(deltas) for call in d.tool_calls or []]
    assert content_at < calls[0][0]  # content before the block streams as content, first
    first = [call for _, call in calls if call.id is not None]
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in first] == [
        (0, "function", "get_weather", ""),
        (1, "function", "get_time", ""),
    ]
    pieces = [call.function.arguments for _, call in calls if call.id is None and call.index == 0]
    assert len(pieces) > 5 and "".join(pieces) == '{"city": "Paris", "days": [1, 2.5]}'
    assert all(call.function.name is None for _, call in calls if call.id is None)
    assert deltas[-1][1] == "tool_calls"


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("<tool_call>{bad}</tool_call> after", "<tool_call>{bad}</tool_call> after"),
        ('<tool_call>{"name": 7}</tool_call>', '<tool_call>{"name": 7}</tool_call>'),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),
        ('x <tool_call>{"arguments": {"a": 1', 'x <tool_call>{"arguments": {"a": 1'),
    ],
)
def test_a_block_that_breaks_before_its_name_stays_content(
    tokenizer: TextTokenizer, text: str, content: str
) -> None:
    fmt = _format(tokenizer)
    whole = _whole(fmt, text)
    assert whole["message"] == {"role": "assistant", "content": content}
    assert whole["finish_reason"] == "stop"
    for step in (1, 4):
        streamed = _accumulated(_stream(fmt, text, step))
        assert (streamed.message.content, streamed.message.tool_calls) == (content, None)


@pytest.mark.parametrize(
    ("text", "arguments", "content"),
    [
        # the JSON breaks after the name: the call keeps what was streamed, the block's rest is dropped
        ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> after', '{"a": 1', " after"),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call>', '{"a": 1}', None),
        # the reply ends inside the block
        ('<tool_call>{"name": "f", "arguments": {"a": "tr', '{"a": "tr', None),
        ('<tool_call>{"name": "f"}', "{}", None),
        ('<tool_call>{"name": "f", "x": [1, {"name": "g"}]}</tool_call>', "{}", None),
    ],
)
def test_a_named_call_keeps_what_was_streamed(
    tokenizer: TextTokenizer, text: str, arguments: str, content: str | None
) -> None:
    fmt = _format(tokenizer)
    whole = _whole(fmt, text)
    (call,) = whole["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("f", arguments)
    assert whole["message"]["content"] == content
    for step in (1, 3, 1000):
        streamed = _accumulated(_stream(fmt, text, step))
        assert (streamed.message.content or None) == content  # the role chunk opens content with ""
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            ("f", arguments)
        ]


def test_without_parallel_tool_calls_only_the_first_call_streams(tokenizer: TextTokenizer) -> None:
    fmt = _format(tokenizer, parallel=False)
    streamed = _accumulated(_stream(fmt, TWO_CALLS + " done", 4))
    assert [c.function.name for c in streamed.message.tool_calls] == ["get_weather"]
    assert streamed.message.content == "Let me look. \n done"
    assert _whole(fmt, TWO_CALLS + " done")["message"]["content"] == "Let me look. \n done"


def test_a_closing_tag_inside_an_argument_string_is_part_of_it() -> None:
    parser = ToolCallParser()
    content, deltas = parser.push(
        '<tool_call>{"name": "w", "arguments": {"s": "</tool_call>"}}</tool_call>.', end=True
    )
    assert content == "."
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"s": "</tool_call>"}'


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "b": [true, false, null, -0.5e3, 10], "c": {"d": "\\n\\t\\u00e9\\/"}, "e": {}, "f": []}',
        ' {\n "x" : "\\ud83d\\ude00" , "y":1E2 } ',
    ],
)
def test_the_json_stream_rewrites_as_json_dumps(text: str) -> None:
    stream = JsonObjectStream()
    pieces = [piece for char in text for _, _, piece in stream.feed(char)]
    assert stream.done
    assert "".join(pieces) == json.dumps(json.loads(text), ensure_ascii=False)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[1]", "'[' does not start an object"),
        ('{"a" 1}', "unexpected '1'"),
        ('{"a": tru}', "'tru' is not a number or literal"),
        ('{"a": 01}', "'01' is not a number or literal"),
        ('{"a": 1,}', "unexpected '}'"),
        ('{"a": 1]', "unexpected ']'"),
        ('{"a": "\\x"}', "bad escape \\x"),
        ('{"a": "\\u12g4"}', "bad \\u escape 'u12g'"),
        ('{"a": "\x01"}', "unescaped control character '\\x01' in a string"),
    ],
)
def test_the_json_stream_stops_at_the_first_bad_character(text: str, error: str) -> None:
    stream = JsonObjectStream()
    with pytest.raises(JsonSyntaxError) as raised:
        for char in text:
            stream.feed(char)
    assert str(raised.value) == error


def test_a_lone_surrogate_stays_an_escape_so_the_reply_encodes() -> None:
    stream = JsonObjectStream()
    text = '{"s": "\\ud83d!"}'
    pieces = "".join(piece for char in text for _, _, piece in stream.feed(char))
    assert pieces == '{"s": "\\ud83d!"}'
    pieces.encode("utf-8")


def test_tool_choice_none_leaves_blocks_in_the_text(tokenizer: TextTokenizer) -> None:
    tool = {"type": "function", "function": {"name": "get_time"}}
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="none"
    )
    assert not body.parses_tool_calls
    fmt = ChatFormat(tokenizer, "tiny", want_logprobs=False, parses_tool_calls=body.parses_tool_calls)
    assert _whole(fmt, TWO_CALLS)["message"] == {"role": "assistant", "content": TWO_CALLS}
    streamed = _accumulated(_stream(fmt, TWO_CALLS, 3))
    assert (streamed.message.content, streamed.message.tool_calls, streamed.finish_reason) == (
        TWO_CALLS,
        None,
        "stop",
    )


# renders a past call as Qwen3.5's template does: one line per argument, which needs an object
PAST_CALLS = (
    "{%- for m in messages %}{%- for call in m.tool_calls or [] %}"
    "{{ call.function.name }}({%- for k, v in call.function.arguments | items %}{{ k }}={{ v }};{%- endfor %})"
    "{%- endfor %}{%- endfor %}"
)


def test_an_assistants_past_call_reaches_the_template_with_object_arguments() -> None:
    def turn(arguments: str) -> list[dict[str, Any]]:
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        ]

    body = ChatCompletionRequest(messages=turn('{"city": "Paris", "days": 2}'))
    rendered = ChatTemplate(PAST_CALLS).render([m.for_template() for m in body.messages])
    assert rendered == "f(city=Paris;days=2;)"
    assert ChatCompletionRequest(messages=turn("")).messages[1].for_template()["tool_calls"][0][
        "function"
    ] == {
        "name": "f",
        "arguments": {},
    }
    with pytest.raises(ValidationError, match="tool_calls.0.function.arguments is not JSON"):
        ChatCompletionRequest(messages=turn("{oops"))


# Qwen3.5 writes its calls as XML inside the block; values take their parameters' schema types
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "where": {"type": "object"},
            },
        },
    },
}
XML_CALLS = (
    'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n7 "Paris"\n</parameter>\n'
    '<parameter=days>\n3\n</parameter>\n<parameter=where>\n{"lat": 48.9}\n</parameter>\n'
    "<parameter=note>\n12\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_qwen35_xml_calls_stream_as_their_whole_reply(tokenizer: TextTokenizer, step: int) -> None:
    fmt = ChatFormat(tokenizer, "tiny", want_logprobs=False, parses_tool_calls=True, tools=[WEATHER_TOOL])
    whole = _whole(fmt, XML_CALLS)
    assert whole["message"]["content"] == "Checking.\n\n" and whole["finish_reason"] == "tool_calls"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert calls == [
        ("get_weather", '{"city": "7 \\"Paris\\"", "days": 3, "where": {"lat": 48.9}, "note": "12"}'),
        ("get_time", "{}"),
    ]
    chunks = _stream(fmt, XML_CALLS, step)
    streamed = _accumulated(chunks)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    if step == 1:  # one piece a parameter as it closes, then the closing brace
        pieces = [
            call.function.arguments
            for chunk in chunks
            for call in chunk.choices[0].delta.tool_calls or []
            if call.index == 0 and call.id is None
        ]
        assert pieces == [
            '{"city": "7 \\"Paris\\""',
            ', "days": 3',
            ', "where": {"lat": 48.9}',
            ', "note": "12"',
            "}",
        ]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("<tool_call>\n<func=f>\n</func>\n</tool_call>", "<tool_call>\n<func=f>\n</func>\n</tool_call>", []),
        ("<tool_call><function=>x</tool_call>", "<tool_call><function=>x</tool_call>", []),
        # broken after the name: the call keeps the parameters that closed
        (
            "<tool_call><function=f><parameter=a>1</parameter><oops></tool_call> end",
            " end",
            [("f", '{"a": "1"')],
        ),
        ("<tool_call><function=f><parameter=a>1", None, [("f", "")]),
    ],
)
def test_broken_xml_calls(tokenizer: TextTokenizer, text: str, content: str | None, calls: list) -> None:
    fmt = _format(tokenizer)
    whole = _whole(fmt, text)
    assert whole["message"]["content"] == content
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls", [])
    ] == calls
    streamed = _accumulated(_stream(fmt, text, 1))
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == calls
