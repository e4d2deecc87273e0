"""vLLM's sampling extras, echo and prompt logprobs, batched prompts and n > 1, OpenAI's error
shape and model lookup, against a live ``phalanx serve`` (TP 2, CPU) on the tiny model, whose
prompts are prefilled in chunks of 16 tokens: every extra either acts or is refused with a 400
naming it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from phalanx.server.detokenizer import TextTokenizer
from tests.support.live_server import MODEL_NAME, metric, wait_for_metric


@pytest.fixture(scope="module")
def base_url(tiny_server_small_batches: str) -> str:
    return tiny_server_small_batches


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def word_id(tiny_model_dir: Path) -> int:
    """A token that is a plain word on its own (its text is itself)."""
    tokenizer = TextTokenizer.from_model_dir(tiny_model_dir)
    (token,) = tokenizer.encode(" the", add_special_tokens=False)
    return token


def complete(client: openai.OpenAI, **extra: object) -> openai.types.Completion:
    body = {"ignore_eos": True, **extra}
    return client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, temperature=0.0, extra_body=body
    )


def test_logit_bias_forces_a_token(client: openai.OpenAI, word_id: int) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0.0, logit_bias={str(word_id): 100}
    )
    assert out.choices[0].text == " the" * 4


def test_stop_token_ids_end_the_text_without_the_stop_token(client: openai.OpenAI, word_id: int) -> None:
    forced = {"logit_bias": {str(word_id): 100}, "stop_token_ids": [word_id]}
    hidden = complete(client, **forced)
    assert (hidden.choices[0].text, hidden.choices[0].finish_reason) == ("", "stop")
    assert hidden.usage.completion_tokens == 1
    shown = complete(client, **forced, include_stop_str_in_output=True)
    assert shown.choices[0].text == " the"


def test_min_tokens_holds_the_stop_token_back(client: openai.OpenAI, word_id: int) -> None:
    # as vLLM: the stop token may come once min_tokens others are out
    out = complete(client, logit_bias={str(word_id): 100}, stop_token_ids=[word_id], min_tokens=3)
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "stop"
    assert " the" not in out.choices[0].text


def test_stop_strings_wait_for_min_tokens_and_may_be_kept(client: openai.OpenAI, word_id: int) -> None:
    forced = {"logit_bias": {str(word_id): 100}}
    cut = complete(client, **forced, stop=["the"], include_stop_str_in_output=True)
    assert (cut.choices[0].text, cut.usage.completion_tokens) == (" the", 1)
    late = complete(client, **forced, stop=["the"], min_tokens=3)
    assert (late.choices[0].text, late.usage.completion_tokens) == (" the the ", 3)


def test_min_p_one_keeps_only_the_most_likely_token(client: openai.OpenAI) -> None:
    greedy = complete(client)
    for seed in (1, 2):
        sampled = client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            max_tokens=5,
            temperature=1.5,
            seed=seed,
            extra_body={"ignore_eos": True, "min_p": 1.0},
        )
        assert sampled.choices[0].text == greedy.choices[0].text


def test_completion_logprobs_have_vllm_shape_and_offsets_in_text(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, logprobs=3, temperature=0.0
    )
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert isinstance(logprobs, openai.types.completion_choice.Logprobs)
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == logprob and 1 <= len(top) <= 4
    offsets = [*logprobs.text_offset, len(choice.text)]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    pieces = [choice.text[a:b] for a, b in zip(offsets, offsets[1:], strict=False)]
    assert "".join(pieces) == choice.text


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "suffix", "end"),
        ("/v1/completions", "guided_grammar", "root ::= 'a'"),
        ("/v1/chat/completions", "continue_final_message", True),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ],
)
def test_unknown_fields_are_refused_by_name(base_url: str, path: str, field: str, value: object) -> None:
    body: dict[str, object] = {"model": MODEL_NAME, field: value, "max_tokens": 2}
    body.update(
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    response = httpx.post(base_url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": f"{field}: this field is not supported by this server",
        "type": "invalid_request_error",
        "param": field,
        "code": None,
    }


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        (
            {"logit_bias": {"x": 1}},
            "logit_bias: keys must be token ids, got 'x'",
            "logit_bias",
        ),
        ({"logit_bias": {"5": 101}}, "bias of token 5 must be in [-100, 100], got 101", "logit_bias"),
        (
            {"logit_bias": {"999999": 1}},
            "logit_bias: token id 999999 is outside the vocabulary",
            "logit_bias",
        ),
        ({"stop_token_ids": [-1]}, "stop_token_ids: token id -1 is outside the vocabulary", "stop_token_ids"),
        (
            {"min_tokens": 9, "max_tokens": 4},
            "min_tokens must be an integer in [0, max_tokens], got 9",
            "min_tokens",
        ),
        ({"min_p": 2}, "min_p: Input should be less than or equal to 1", "min_p"),
        ({"presence_penalty": 0.5}, "presence_penalty: not supported (only 0.0)", "presence_penalty"),
        ({"repetition_penalty": 1.1}, "repetition_penalty: not supported (only 1.0)", "repetition_penalty"),
    ],
)
def test_bad_extras_get_400_naming_them(base_url: str, extra: dict, message: str, param: str | None) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **extra}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_unknown_routes_and_methods_answer_in_openai_shape(base_url: str) -> None:
    missing = httpx.post(base_url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "no route POST /v1/embeddings",
            "type": "not_found_error",
            "param": None,
            "code": None,
        }
    }
    wrong_method = httpx.get(base_url + "/v1/completions", timeout=30)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"] == "GET /v1/completions: Method Not Allowed"


def test_one_model_by_id(base_url: str, client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (MODEL_NAME, "model", "phalanx")
    with pytest.raises(openai.NotFoundError, match="model 'other' does not exist here"):
        client.models.retrieve("other")
    missing = httpx.get(base_url + "/v1/models/other", timeout=30).json()["error"]
    assert (missing["param"], missing["code"]) == ("model", "model_not_found")


LONG_PROMPT = list(range(10, 50))  # 40 tokens: three prefill chunks


@pytest.fixture(scope="module")
def reference_logprobs(tiny_model_dir: Path) -> torch.Tensor:
    """transformers' fp32 log-probabilities after each token of LONG_PROMPT."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([LONG_PROMPT])).logits[0].float(), dim=-1)


def test_echo_returns_the_prompt_scored_like_transformers(
    client: openai.OpenAI, reference_logprobs: torch.Tensor
) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=2, logprobs=2, echo=True, temperature=0.0
    )
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(LONG_PROMPT) + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [reference_logprobs[i - 1, t].item() for i, t in enumerate(LONG_PROMPT) if i > 0]
    assert logprobs.token_logprobs[1 : len(LONG_PROMPT)] == pytest.approx(expected, abs=1e-4)
    for token, logprob, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert top[token] == logprob
    offsets = [*logprobs.text_offset, len(choice.text)]
    assert offsets == sorted(offsets) and offsets[0] == 0
    plain = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=2, temperature=0.0)
    assert choice.text.endswith(plain.choices[0].text) and len(choice.text) > len(plain.choices[0].text)


def test_prompt_logprobs_in_vllm_shape(base_url: str, reference_logprobs: torch.Tensor) -> None:
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 1, "prompt_logprobs": 3}
    choice = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(LONG_PROMPT) and scored[0] is None
    for position, entry in enumerate(scored[1:], start=1):
        row = reference_logprobs[position - 1]
        token = LONG_PROMPT[position]
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(3).indices.tolist()
        assert [entry[str(i)]["rank"] for i in top] == [1, 2, 3]
        assert set(entry) == {str(token), *map(str, top)}
    assert choice["logprobs"] is None


def test_batched_prompts_answer_as_indexed_choices(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The quick brown fox", "Hello"]
    together = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
    )
    alone = [complete_text(client, p) for p in prompts]
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == 12


def complete_text(client: openai.OpenAI, prompt: str, **extra: object) -> openai.types.Completion:
    return client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=4,
        temperature=0.0,
        extra_body={"ignore_eos": True, **extra},
    )


def test_n_choices_use_derived_seeds(client: openai.OpenAI) -> None:
    def sampled(n: int, seed: int) -> list[str]:
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=["Hello", "Once upon a time"],
            max_tokens=6,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in out.choices] == list(range(2 * n)) and out.usage.completion_tokens == 12 * n
        return [c.text for c in out.choices]

    three = sampled(3, 11)
    assert three == sampled(3, 11)
    assert [three[0], three[3]] == sampled(1, 11)  # sample 0 keeps the request's seed
    assert len({three[0], three[1], three[2]}) == 3


def test_streamed_choices_carry_their_index(client: openai.OpenAI) -> None:
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    }
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    texts, finished, usage = ["", ""], [None, None], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
        usage = chunk.usage or usage
    assert finished == ["length", "length"] and usage.completion_tokens == 10
    whole = client.chat.completions.create(**request)
    assert [c.message.content for c in whole.choices] == texts


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"prompt": "hi", "prompt_logprobs": 21},
            "prompt_logprobs: Input should be less than or equal to 20",
        ),
        ({"prompt": ["a", ""]}, "prompt 1 is empty"),
    ],
)
def test_bad_prompt_options_get_400(base_url: str, body: dict, message: str) -> None:
    response = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_echo_with_max_tokens_0_is_the_prompt_alone(
    client: openai.OpenAI, base_url: str, reference_logprobs: torch.Tensor
) -> None:
    prompt_tokens = metric(base_url, "phalanx_prompt_tokens_total")
    whole = client.completions.create(
        model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=0, logprobs=2, echo=True
    )
    assert metric(base_url, "phalanx_prompt_tokens_total") == prompt_tokens + len(LONG_PROMPT)
    choice = whole.choices[0]
    assert (choice.finish_reason, whole.usage.completion_tokens) == ("length", 0)
    assert whole.usage.prompt_tokens == len(LONG_PROMPT)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(LONG_PROMPT) and logprobs.token_logprobs[0] is None
    expected = [reference_logprobs[i - 1, t].item() for i, t in enumerate(LONG_PROMPT) if i > 0]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    one = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=1, logprobs=2, echo=True)
    assert one.choices[0].text.startswith(choice.text)  # the token may have no text: count entries
    assert len(one.choices[0].logprobs.tokens) == len(LONG_PROMPT) + 1
    assert one.choices[0].logprobs.token_logprobs[: len(LONG_PROMPT)] == logprobs.token_logprobs
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=0, logprobs=2, echo=True, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    wait_for_metric(base_url, "phalanx_slots_used", 0)  # each one freed its slot and pages
    wait_for_metric(base_url, "phalanx_kv_pages_used", 0)


def test_lm_eval_style_scoring_with_max_tokens_0(base_url: str) -> None:
    prompts = [LONG_PROMPT[:9], LONG_PROMPT[5:30]]
    request = {"model": MODEL_NAME, "prompt": prompts, "logprobs": 1, "echo": True, "temperature": 0.0}
    scored = httpx.post(base_url + "/v1/completions", json={**request, "max_tokens": 0}, timeout=60).json()
    sampled = httpx.post(base_url + "/v1/completions", json={**request, "max_tokens": 1}, timeout=60).json()
    assert [c["finish_reason"] for c in scored["choices"]] == ["length", "length"]
    assert scored["usage"]["completion_tokens"] == 0
    for prompt, zero, one in zip(prompts, scored["choices"], sampled["choices"], strict=True):
        assert len(zero["logprobs"]["tokens"]) == len(prompt)
        # close, not equal: the two requests' prompts may share their steps differently (CPU
        # matmuls round by the batch's shape)
        assert zero["logprobs"]["token_logprobs"] == pytest.approx(
            one["logprobs"]["token_logprobs"][: len(prompt)], abs=1e-5
        )
        scored_top, sampled_top = zero["logprobs"]["top_logprobs"], one["logprobs"]["top_logprobs"]
        for position, top in enumerate(scored_top):
            assert top == pytest.approx(sampled_top[position], abs=1e-5)


def test_max_tokens_0_without_echo_is_a_400(base_url: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": "max_tokens: 0 is accepted only with echo (the answer is the prompt)",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
