"""Tools and structured output against a live ``phalanx serve`` (TP 2, CPU) on the tiny model: tools
reach the chat template, a demanded tool call comes back as ``tool_calls`` (whole and streamed),
response formats and vLLM's guided decoding constrain the reply, bad constraints are 400s naming
their field; langchain-openai's ``bind_tools`` and ``with_structured_output`` work unchanged. The
tiny model's weights are random: only the grammar makes its replies well-formed."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.support.live_server import MODEL_NAME

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(tiny_server: str) -> str:
    return tiny_server


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_tools_reach_the_chat_template(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1)
    offered = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1, tools=[WEATHER])
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def _check_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "London") and args["unit"] in ("celsius", "fahrenheit")


def test_a_named_tool_choice_comes_back_as_a_tool_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=80,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)
    assert not choice.message.content


def test_a_required_tool_call_streams_as_delta_tool_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=80, tools=[WEATHER], tool_choice="required", stream=True
    )
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and {d.index for d in deltas} == {0}
    name = deltas[0].function.name  # the first delta names the call; its arguments follow in pieces
    _check_call(name, "".join(d.function.arguments or "" for d in deltas))


class Weather(BaseModel):
    # No other keys: with them allowed, a random model may spend max_tokens inside an extra key.
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "London"]
    sunny: bool


def test_json_schema_response_format_constrains_the_reply(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=60,
        seed=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": Weather.model_json_schema(), "strict": True},
        },
    )
    Weather.model_validate_json(out.choices[0].message.content)
    assert out.choices[0].finish_reason == "stop"


def test_guided_choice_and_regex_on_completions(client: openai.OpenAI) -> None:
    for seed in range(3):
        picked = client.completions.create(
            model=MODEL_NAME,
            prompt="Pick one:",
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": ["yes", "no", "maybe not"]},
        )
        assert picked.choices[0].text in ("yes", "no", "maybe not")
    dated = client.completions.create(
        model=MODEL_NAME, prompt="Date:", max_tokens=20, extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"}
    )
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", dated.choices[0].text)


def test_json_object_starts_an_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=8, response_format={"type": "json_object"}
    )
    assert out.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
            "response_format",
            "response_format: Invalid type: objectx",
        ),
        (
            "/v1/completions",
            {"guided_json": "{not json"},
            "guided_json",
            "guided_json: the schema is not valid JSON",
        ),
        ("/v1/completions", {"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice",
            "tool_choice: no tool named 'get_time' among the tools offered (get_weather)",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, None, "tool_choice needs tools"),
        (
            "/v1/completions",
            {"guided_regex": "a", "guided_choice": ["a"]},
            None,
            "guided_choice cannot be combined",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    base_url: str, path: str, extra: dict, param: str | None, message: str
) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": ASK})
    response = httpx.post(base_url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_langchain_bind_tools_gets_tool_calls(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL_NAME, base_url=base_url + "/v1", api_key="unused", max_tokens=80, max_retries=0
    )
    reply = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather"
    assert call["args"]["city"] in ("Paris", "London")


def test_langchain_with_structured_output_returns_a_parsed_object(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL_NAME, base_url=base_url + "/v1", api_key="unused", max_tokens=60, max_retries=0
    )
    weather = llm.with_structured_output(Weather).invoke("What is the weather in Paris?")
    assert isinstance(weather, Weather)
