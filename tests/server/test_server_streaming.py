"""Streaming against a live ``phalanx serve`` (TP 2, CPU, prompts prefilled in chunks of 16 tokens)
on the tiny model: ``echo`` and ``prompt_logprobs`` stream on /v1/completions as vLLM streams echo
(the prompt in each choice's first chunk), and a tool call streams as OpenAI streams it (the name,
then the arguments in pieces); each streamed reply, joined, equals the same request unstreamed,
read through the ``openai`` client's stream types and langchain-openai's ``.stream`` (and its
completions ``OpenAI.batch``, which sends its prompts in one request)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.support.live_server import MODEL_NAME

PROMPT = list(range(10, 50))  # 40 tokens: three prefill chunks, scored in three spans
# enums only: the random model's arguments stay short under the grammar
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "string", "enum": ["06:30", "07:00"]},
                "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
            },
            "required": ["hour", "days"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "set_alarm"}}
ASK_TEXT = "Wake me up tomorrow."
ASK = [{"role": "user", "content": ASK_TEXT}]
LANGCHAIN = {"model": MODEL_NAME, "api_key": "unused", "temperature": 0.0, "max_retries": 0}


@pytest.fixture(scope="module")
def base_url(tiny_server_small_batches: str) -> str:
    return tiny_server_small_batches


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _joined_completion(chunks: list[openai.types.Completion]) -> dict[int, dict[str, Any]]:
    """Each choice's streamed text, logprobs lists, finish reason and first chunk's extras."""
    joined: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            into = joined.setdefault(
                choice.index,
                {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
            )
            into.setdefault("first", choice)
            into["text"] += choice.text
            into["finish"] = choice.finish_reason or into.get("finish")
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                into[key] += getattr(choice.logprobs, key) if choice.logprobs else []
    return joined


def _whole_logprobs(choice: openai.types.CompletionChoice) -> dict[str, list]:
    logprobs = choice.logprobs
    return {k: getattr(logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def test_echo_with_logprobs_streams_what_the_whole_reply_holds(client: openai.OpenAI) -> None:
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "echo": True}
    request |= {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**request).choices[0]
    chunks = list(client.completions.create(**request, stream=True))
    (streamed,) = _joined_completion(chunks).values()
    assert streamed["text"] == whole.text
    assert {k: streamed[k] for k in _whole_logprobs(whole)} == _whole_logprobs(whole)
    assert streamed["finish"] == whole.finish_reason == "length"
    # as vLLM: the first chunk holds the whole prompt (its first token unscored) and the first token
    first = chunks[0].choices[0]
    assert len(first.logprobs.tokens) == len(PROMPT) + 1
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
    assert whole.text.startswith(first.text) and len(first.text) < len(whole.text)


def test_prompt_logprobs_and_echo_stream_in_each_choices_first_chunk(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The quick brown fox"]
    request = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 3, "echo": True, "n": 2, "seed": 3}
    request |= {"extra_body": {"ignore_eos": True, "prompt_logprobs": 2}}
    whole = client.completions.create(**request)
    streamed = _joined_completion(list(client.completions.create(**request, stream=True)))
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in whole.choices:
        mine = streamed[choice.index]
        assert mine["text"] == choice.text and mine["finish"] == choice.finish_reason
        assert mine["first"].prompt_logprobs == choice.prompt_logprobs
        assert choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) > 1
        assert mine["tokens"] == []  # no logprobs asked: none streamed
    assert whole.choices[0].text.startswith("Once upon a time")


def test_prompt_logprobs_do_not_stream_in_chat(base_url: str) -> None:
    body = {"model": MODEL_NAME, "messages": ASK, "prompt_logprobs": 1, "stream": True}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert (
        "prompt_logprobs is not supported with stream in chat completions"
        in response.json()["error"]["message"]
    )


def _tool_request() -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": ASK,
        "max_tokens": 150,
        "temperature": 0.0,
        "tools": [ALARM],
        "tool_choice": NAMED,
    }


def test_a_tool_call_streams_its_arguments_in_pieces(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**_tool_request()).choices[0]
    chunks = list(client.chat.completions.create(**_tool_request(), stream=True))
    deltas = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]
    announce, *pieces = deltas
    assert (announce.index, announce.type, announce.function.name) == (0, "function", "set_alarm")
    assert announce.id.startswith("call_") and len(pieces) > 3
    assert all(piece.id is None and piece.function.name is None for piece in pieces)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    (call,) = streamed.message.tool_calls
    (expected,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        expected.function.name,
        expected.function.arguments,
    )
    assert call.function.arguments.startswith('{"hour": "0')


def test_langchain_streams_tool_call_chunks(base_url: str, client: openai.OpenAI) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url + "/v1", max_tokens=150, **LANGCHAIN)
    bound = llm.bind_tools([ALARM], tool_choice="set_alarm")
    chunks = list(bound.stream(ASK_TEXT))
    assert sum(bool(chunk.tool_call_chunks) for chunk in chunks) > 3
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    (call,) = merged.tool_calls
    (expected,) = bound.invoke(ASK_TEXT).tool_calls
    assert (call["name"], call["args"]) == (expected["name"], expected["args"])
    assert call["name"] == "set_alarm" and call["args"]["hour"] in ("06:30", "07:00")


def test_langchain_completions_batch_and_stream(base_url: str) -> None:
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=base_url + "/v1", max_tokens=4, **LANGCHAIN)
    prompts = ["Once upon a time", "The quick brown fox", "Hello"]
    together = llm.batch(prompts)  # one request holding the three prompts
    assert together == [llm.invoke(prompt) for prompt in prompts]
    assert "".join(llm.stream(prompts[0])) == together[0]
