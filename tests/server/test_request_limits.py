"""Every request field bounded at the edge: a real ``phalanx serve`` (TP 2, CPU) answers values
outside the limits table with a 400 naming the field, bodies over the size limit with a 413, and
no input at all (hypothesis, over every field and JSON type) with a 5xx or a poisoned replica."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.server.prompt_tokens import SLICE_CHARS
from tests.support.live_server import MODEL_NAME

INT64 = 1 << 63
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base_url(tiny_server: str) -> str:
    return tiny_server


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def _body(endpoint: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2}
    base.update({"prompt": "hi"} if endpoint == COMPLETIONS else {"messages": MESSAGES})
    base.update(fields)
    return base


def _assert_healthy(http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200, health.text


OUT_OF_RANGE = [
    (COMPLETIONS, "top_k", 9223372036854775808),
    (COMPLETIONS, "top_k", 18446744073709551616),
    (COMPLETIONS, "top_k", 2**31),
    (COMPLETIONS, "top_k", -2),
    (COMPLETIONS, "seed", INT64),
    (COMPLETIONS, "seed", -INT64 - 1),
    (COMPLETIONS, "max_tokens", True),
    (COMPLETIONS, "max_tokens", "4"),
    (COMPLETIONS, "max_tokens", 2**31),
    (COMPLETIONS, "max_tokens", 0),
    (COMPLETIONS, "temperature", 2.5),
    (COMPLETIONS, "temperature", True),
    (COMPLETIONS, "temperature", "0.5"),
    (COMPLETIONS, "top_p", 0),
    (COMPLETIONS, "top_p", 1.5),
    (COMPLETIONS, "stop", ""),
    (COMPLETIONS, "stop", ["x"] * 17),
    (COMPLETIONS, "stop", "y" * 513),
    (COMPLETIONS, "logprobs", 21),
    (COMPLETIONS, "logprobs", True),
    (COMPLETIONS, "prompt", [True, 1]),
    (COMPLETIONS, "prompt", [2**31]),
    (COMPLETIONS, "stream", "yes"),
    (COMPLETIONS, "ignore_eos", 1),
    (COMPLETIONS, "model", "m" * 257),
    (CHAT, "max_completion_tokens", True),
    (CHAT, "logprobs", 1),
    (CHAT, "top_logprobs", 21),
    (CHAT, "add_generation_prompt", "no"),
    (CHAT, "chat_template_kwargs", {"messages": []}),
    (CHAT, "chat_template_kwargs", {"add_generation_prompt": False}),
    (CHAT, "stream_options", {"include_usage": 1}),
]


@pytest.mark.parametrize(("endpoint", "field", "value"), OUT_OF_RANGE)
def test_out_of_range_field_is_a_400_naming_it(
    http: httpx.Client, endpoint: str, field: str, value: Any
) -> None:
    response = http.post(endpoint, json=_body(endpoint, **{field: value}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert error["message"].startswith(field)


@pytest.mark.parametrize(
    ("raw", "field"),
    [('"temperature": 1e400', "temperature"), ('"top_p": NaN', "top_p"), ('"seed": -Infinity', "seed")],
)
def test_json_beyond_finite_numbers_is_a_400(http: httpx.Client, raw: str, field: str) -> None:
    body = '{"model": ' + json.dumps(MODEL_NAME) + ', "prompt": "hi", "max_tokens": 2, ' + raw + "}"
    response = http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_the_replica_serves_after_every_refusal(http: httpx.Client) -> None:
    for endpoint, field, value in OUT_OF_RANGE:
        http.post(endpoint, json=_body(endpoint, **{field: value}))
    _assert_healthy(http)
    reply = http.post(COMPLETIONS, json=_body(COMPLETIONS, top_k=2**31 - 1, seed=INT64 - 1, temperature=1.0))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_a_tiny_temperature_is_greedy(http: httpx.Client) -> None:
    def tokens(temperature: float) -> list[int]:
        body = _body(COMPLETIONS, prompt=[5, 6, 7], max_tokens=8, temperature=temperature, ignore_eos=True)
        reply = http.post(COMPLETIONS, json={**body, "logprobs": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["logprobs"]["tokens"]

    assert tokens(1e-308) == tokens(0.0) == tokens(5e-324)


def test_a_body_over_the_limit_is_a_413(http: httpx.Client) -> None:
    huge = json.dumps(_body(COMPLETIONS, prompt="a " * (4 * 1024 * 1024 + 1)))
    declared = http.post(COMPLETIONS, content=huge, headers={"content-type": "application/json"})
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"
    assert "8388608-byte limit" in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as the body arrives
        for start in range(0, len(huge), 1 << 20):
            yield huge[start : start + (1 << 20)].encode()

    chunked = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert chunked.json()["error"]["code"] == "request_too_large"
    _assert_healthy(http)


def _largest_gap_of_a_stream_while(http: httpx.Client, refused: Callable[[], None]) -> float:
    """Run ``refused`` while a long generation streams; the largest gap between its events (s),
    up to the first event after ``refused`` returned (the stream is then closed, not read out)."""
    gaps: list[float] = []
    streaming, refusal_done, outlived = threading.Event(), threading.Event(), threading.Event()

    def stream() -> None:
        body = _body(COMPLETIONS, prompt=[5, 6, 7], max_tokens=400, ignore_eos=True, stream=True)
        with httpx.stream("POST", http.base_url.join(COMPLETIONS), json=body, timeout=60) as reply:
            last = None
            for line in reply.iter_lines():
                now = time.monotonic()
                if line.startswith("data:") and last is not None:
                    gaps.append(now - last)
                    if refusal_done.is_set():  # this gap spans the refusal's end
                        outlived.set()
                        return
                last = now
                streaming.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert streaming.wait(30)
    try:
        refused()
    finally:
        refusal_done.set()
        streamer.join()
    assert outlived.is_set(), "the stream ended before the refusal did"
    return max(gaps)


def test_a_prompt_far_over_the_context_is_refused_while_tokenizing(http: httpx.Client) -> None:
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    text = "lorem ipsum dolor " * 400_000  # 7.2 MB: under the body limit, far over the context

    def refuse_the_long_prompt() -> None:
        started = time.monotonic()
        long = http.post(COMPLETIONS, json=_body(COMPLETIONS, prompt=text))
        assert time.monotonic() - started < 5.0
        assert long.status_code == 400, long.text
        error = long.json()["error"]
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
        said = re.fullmatch(
            rf"This model's maximum context length is {context} tokens, and the prompt has at least"
            r" (\d+) tokens \(at least one token must be left for the completion\)\.",
            error["message"],
        )
        # counting stopped within one slice of the context, not at the text's 1.2 M tokens
        assert said is not None and context <= int(said[1]) <= context + SLICE_CHARS, error["message"]

    slowest = _largest_gap_of_a_stream_while(http, refuse_the_long_prompt)
    assert slowest < 1.0, f"a stream waited {slowest:.2f} s for a token while a long prompt was refused"


def test_chat_messages_far_over_the_context_are_refused_without_stalling(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "lorem ipsum " * 40}] * 12_000  # rendered, then refused

    def refuse_the_long_chat() -> None:
        reply = http.post(CHAT, json=_body(CHAT, messages=messages))
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
        assert "and the prompt has at least" in error["message"]

    slowest = _largest_gap_of_a_stream_while(http, refuse_the_long_chat)
    assert slowest < 1.0, f"a stream waited {slowest:.2f} s for a token while a long chat was refused"


# -- no input gives a 5xx or poisons ----------------------------------------------------------------

_ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, INT64 - 1, INT64, 2**64, -(2**64)])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, 1e-308, 5e-324, 2.0, 1e308])
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["messages", "add_generation_prompt", "x"]) | st.text(max_size=6),
            inner,
            max_size=3,
        )
    ),
    max_leaves=6,
)
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "add_generation_prompt",
    "chat_template_kwargs",
    "tools",
]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    endpoint=st.sampled_from([COMPLETIONS, CHAT]),
    overrides=st.dictionaries(st.sampled_from(_FIELDS), _ANY_JSON, max_size=4),
)
def test_no_input_reaches_a_5xx_or_poisons(
    http: httpx.Client, endpoint: str, overrides: dict[str, Any]
) -> None:
    body = {**_body(endpoint), **overrides}
    for field in ("max_tokens", "max_completion_tokens"):  # keep a valid request quick
        value = body.get(field)
        if value is None and field == "max_tokens":
            body[field] = 2
        elif isinstance(value, int) and not isinstance(value, bool):
            body[field] = min(value, 4)
    reply = http.post(endpoint, content=json.dumps(body, allow_nan=False))
    assert reply.status_code < 500, f"{body!r} -> {reply.status_code} {reply.text}"
    if reply.status_code >= 400:
        assert set(reply.json()) == {"error"}, reply.text
    _assert_healthy(http)
