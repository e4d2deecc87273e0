"""A value a rank cannot serve fails its request alone, through real rank processes on the CPU.

The coordinator below reads a vocabulary 64 ids larger than the ranks' model holds (as one that
read another checkpoint's config.json would), so the engine and the executor accept token ids the
ranks must judge themselves. A grammar needs no such double: the engine passes it to rank 0 as it is.
Each bad request ends with one ErrorEvent naming it and the reason, while a request running beside
it completes with the tokens it has alone, and the replica serves on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from phalanx.engine.engine import Engine, EngineConfig, ErrorEvent, FinishEvent, GenerationParams, TokenEvent
from phalanx.executor.launcher import launch_executor
from phalanx.executor.runtime import Executor
from phalanx.models.tiny import MODEL_VOCAB
from phalanx.server.app import create_app

PROMPT = [5, 6, 7, 8]
RUNNING = GenerationParams(max_tokens=24, ignore_eos=True)
SHORT = GenerationParams(max_tokens=4, ignore_eos=True)
BAD_ID = MODEL_VOCAB + 3
OUTSIDE = f"token id {BAD_ID} is outside the vocabulary [0, {MODEL_VOCAB})"


def launch_with_larger_vocab(config: EngineConfig) -> Executor:
    executor = launch_executor(config)
    executor.model_info = dataclasses.replace(executor.model_info, vocab_size=MODEL_VOCAB + 64)
    return executor


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Engine]:
    config = EngineConfig(
        model_dir=tiny_model_dir,
        tp=request.param,
        kv_pages=64,
        page_size=4,
        max_slots=4,
        max_batch_tokens=64,
        step_timeout=30.0,
    )
    engine = Engine.start(config, launch_with_larger_vocab)
    yield engine
    engine.shutdown()


def tokens_and_final(stream) -> tuple[list[int], FinishEvent | ErrorEvent]:
    tokens = []
    for event in stream:
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent | ErrorEvent):
            return tokens, event
    raise AssertionError("the stream ended without a final event")


def fails_alone_beside_a_running_request(engine: Engine, prompt: list[int], params: GenerationParams) -> str:
    """Submit the bad request while another decodes; returns its error text once both ended and
    the replica served a request after them."""
    alone, _ = tokens_and_final(engine.submit(PROMPT, RUNNING))
    running = engine.submit(PROMPT, RUNNING)
    first = running.next_event(timeout=10)
    assert isinstance(first, TokenEvent)  # decoding: the bad request's prompt rides beside its rows
    bad = engine.submit(prompt, params)
    bad_tokens, bad_final = tokens_and_final(bad)
    tokens, final = tokens_and_final(running)
    assert bad_tokens == [] and isinstance(bad_final, ErrorEvent) and bad_final.rejected
    assert [first.token_id, *tokens] == alone and final == FinishEvent("length", len(PROMPT), 24)
    after, final = tokens_and_final(engine.submit(PROMPT, SHORT))
    assert after == alone[:4] and final.reason == "length"
    assert engine.poison_reason is None and engine.closed_reason is None
    return bad_final.message.replace(f"request {bad.request_id} ", "request N ")


def test_an_out_of_vocabulary_prompt_token_fails_its_request_alone(engine: Engine) -> None:
    message = fails_alone_beside_a_running_request(engine, [5, BAD_ID, 7], SHORT)
    assert message == f"request N rejected by rank 0 during unified: prompt {OUTSIDE} (position 1)"


def test_a_rejected_chunk_whose_next_chunk_was_already_sent_fails_its_request_alone(engine: Engine) -> None:
    """The prompt outgrows a step: its second chunk rides in the step sent behind the first."""
    message = fails_alone_beside_a_running_request(engine, [BAD_ID] + [5] * 99, SHORT)
    assert message == f"request N rejected by rank 0 during unified: prompt {OUTSIDE} (position 0)"


def test_a_grammar_rank_0_cannot_compile_fails_its_request_alone(engine: Engine) -> None:
    message = fails_alone_beside_a_running_request(engine, PROMPT, GenerationParams(grammar="("))
    assert message.startswith(
        "request N rejected by rank 0 during unified: grammar does not compile: "
        "1(1): expecting rule, token or statement"
    )


def test_a_rejected_prefill_whose_first_decode_was_already_sent_fails_alone(engine: Engine) -> None:
    """Alone, a prompt is prefilled with its first decode sent behind it (``FED_TOKEN``) before the
    rejection is read: that decode is read too, and the request is dropped from its slot."""
    bad = engine.submit(PROMPT, GenerationParams(max_tokens=8, logit_bias={BAD_ID: 1.0}))
    assert tokens_and_final(bad) == (
        [],
        ErrorEvent(f"request {bad.request_id} rejected by rank 0 during prefill: logit_bias {OUTSIDE}", True),
    )
    tokens, final = tokens_and_final(engine.submit(PROMPT, SHORT))
    assert len(tokens) == 4 and final.reason == "length"
    assert engine.stats().slots_used == 0 and engine.stats().kv_pages_used == 0


def test_the_server_answers_a_rejected_request_with_a_400(engine: Engine, tiny_model_dir: Path) -> None:
    client = TestClient(create_app(engine, tiny_model_dir))
    body = {"prompt": [5, BAD_ID, 7], "max_tokens": 4}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].endswith(f"rejected by rank 0 during prefill: prompt {OUTSIDE} (position 1)")
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "invalid_request_error"
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}).status_code == 200
