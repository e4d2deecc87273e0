"""The OpenAI-compatible server over real HTTP: a real ``phalanx serve`` (TP 2, CPU, real engine)
on the tiny model, driven by the official ``openai`` client and by raw HTTP."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.live_server import MODEL_NAME, live_server, metric, wait_for_metric


@pytest.fixture(scope="module")
def base_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with live_server(tiny_model_dir, log, "--default-max-tokens", "20") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_models_and_health(base_url: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}


def test_completion_usage_logprobs_and_stream_agree(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, logprobs=2, **GREEDY
    )
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 6 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 6
    assert len(choice.logprobs.token_logprobs) == 6
    assert all(math.isfinite(lp) and lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)

    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text  # greedy: same text either way
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_from_token_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=3, **GREEDY)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 3)


def test_chat_stream_and_not(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, how are you?"},
    ]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY
    )
    assert full.choices[0].message.role == "assistant"
    entries = full.choices[0].logprobs.content
    assert len(entries) == 5 and all(math.isfinite(e.logprob) and len(e.top_logprobs) == 2 for e in entries)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (
        chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    )


def test_chat_without_max_tokens_uses_the_server_default(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], **GREEDY
    )
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"


def test_sse_ends_with_done(base_url: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
    printable = [i for i, ch in enumerate(text) if i > 0 and ch.isprintable() and ch != "\ufffd"]
    assert printable, f"no usable stop character in {text!r}"
    stop = text[printable[len(printable) // 2]]
    cut = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, stop=[stop], **GREEDY)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL_NAME,
            prompt="Hello",
            max_tokens=8,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"top_k": 50, "ignore_eos": True},
        )
        return out.choices[0].text

    assert sample(7) == sample(7)


def test_eight_concurrent_streams(base_url: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Count to {i}"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        reasons, usage = [], 0
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return reasons[-1], usage

    async def main() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, i) for i in range(8)))

    assert asyncio.run(main()) == [("length", 12)] * 8


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "hi",', "not valid JSON"),
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, "model 'nope' does not exist"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 5}, "stop"),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": [1] * 5000, "max_tokens": 1},
            "maximum context length",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "max_tokens": 100000},
            "maximum context length",
        ),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 999999]}, "outside the vocabulary"),
        # a field of several types: the error of the type the value had, where it failed
        (
            "/v1/completions",
            {"model": "tiny", "prompt": [1, 2**40]},
            "prompt.1: Input should be less than or equal",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": [[3, -1]]},
            "prompt.0.1: Input should be greater than",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "stop": ["ok", ""]},
            "stop.1: String should have at least",
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "frequency_penalty": 0.5}, "not supported"),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "hi", "n": 9},
            "n is 9, but this server runs at most 8",
        ),
        (
            "/v1/completions",
            '{"model": "tiny", "prompt": "a\\ud800b"}',
            "prompt: the text holds a lone surrogate (U+D800)",
        ),
        ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "lone surrogate (U+DFFF)"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
            "messages: the text holds a lone surrogate (U+D83D)",
        ),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(
    base_url: str, path: str, body: object, message: str
) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        base_url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    ok = httpx.post(
        base_url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="other", prompt="hi", max_tokens=2)


def test_disconnect_mid_stream_frees_the_slot(base_url: str) -> None:
    wait_for_metric(base_url, "phalanx_slots_used", 0)
    cancelled_before = _cancelled(base_url)
    tokens_before = metric(base_url, "phalanx_generation_tokens_total")
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        events = response.iter_lines()
        got = [line for line in (next(events) for _ in range(6)) if line.startswith("data: {")]
        assert got
        assert metric(base_url, "phalanx_slots_used") == 1
        assert metric(base_url, "phalanx_kv_pages_used") > 0
    # the connection is closed with most of the 400 tokens still to come
    wait_for_metric(base_url, "phalanx_slots_used", 0)
    wait_for_metric(base_url, "phalanx_requests_running", 0)
    wait_for_metric(base_url, "phalanx_kv_pages_used", 0)
    assert _cancelled(base_url) == cancelled_before + 1
    # the tokens streamed to the cancelled request were generated, and are counted
    assert metric(base_url, "phalanx_generation_tokens_total") >= tokens_before + len(got)


def test_disconnect_while_waiting_for_a_whole_response(base_url: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, timeout=1.0)
    wait_for_metric(base_url, "phalanx_slots_used", 0)
    wait_for_metric(base_url, "phalanx_kv_pages_used", 0)


def _cancelled(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    for line in text.splitlines():
        if line.startswith('phalanx_requests_total{outcome="cancelled"}'):
            return float(line.split()[-1])
    return 0.0
