"""Server pieces without a running server: chat template (against transformers), incremental
detokenizer, stop strings, reasoning split, and /health once the engine is poisoned."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from phalanx.engine.engine import Engine, GenerationParams
from phalanx.executor.errors import ExecutorPoisoned
from phalanx.executor.model_info import ModelInfo
from phalanx.protocol.messages import Capacity, Decode
from phalanx.server.app import create_app
from phalanx.server.chat_template import ChatTemplate, ChatTemplateError
from phalanx.server.detokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer
from phalanx.server.generation import Chunk, Done, Generation, StopRule
from phalanx.server.metrics import ServerMetrics
from phalanx.server.openai_format import ChatFormat, Collected
from phalanx.server.reasoning import ReasoningSplitter
from phalanx.server.tool_calls import ToolCallParser, whole_calls
from tests.support.fake_ranks import FakeRanks

# A Qwen-style template: system prompt first, tool messages, reasoning kept only in the last
# turn, a thinking switch, and the template's own raise_exception.
QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}{{- raise_exception('System message must be first') }}{%- endif %}"
    "{%- if message.role == 'user' or message.role == 'tool' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
    "{{- eos_token if false else '' }}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ],
]


@pytest.fixture(scope="module")
def qwen_like_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen_like")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_LIKE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [None, False])
def test_chat_template_matches_transformers(
    qwen_like_dir: Path, conversation: int, add_generation_prompt: bool, enable_thinking: bool | None
) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(qwen_like_dir)
    messages = CONVERSATIONS[conversation]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    ours = ChatTemplate.from_model_dir(qwen_like_dir).render(messages, add_generation_prompt, **kwargs)
    assert ours == expected


def test_chat_template_errors_and_sandbox() -> None:
    qwen = ChatTemplate(QWEN_LIKE)
    with pytest.raises(ChatTemplateError, match="System message must be first"):
        qwen.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escape.render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    assert (
        ChatTemplate("{{ bos_token }}{{ messages | tojson }}", bos_token="<s>").render(
            [{"role": "user", "content": "é"}]
        )
        == '<s>[{"role": "user", "content": "é"}]'
    )


def test_incremental_detokenizer_matches_full_decode(tiny_model_dir: Path) -> None:
    tokenizer = TextTokenizer.from_model_dir(tiny_model_dir)
    text = "héllo wörld 世界 🙂 <think>plan</think> done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    im_end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    for sequence in (ids, [*ids, im_end], [400, *ids[:5], 500, *ids[5:]]):  # ids past the tokenizer's vocab
        detokenizer = IncrementalDetokenizer(tokenizer)
        deltas = [detokenizer.push(i) for i in sequence] + [detokenizer.flush()]
        assert "".join(deltas) == tokenizer.decode(sequence)
        assert all("\ufffd" not in d for d in deltas)
    assert tokenizer.decode(ids) == text  # <think> is shown: tokenizer_config marks it not special
    assert "<|im_end|>" not in tokenizer.decode([*ids, im_end])
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1  # one character over several byte tokens
    split = IncrementalDetokenizer(tokenizer)  # a special id between a character's bytes hides nothing
    assert "".join([split.push(i) for i in [emoji[0], im_end, *emoji[1:]]] + [split.flush()]) == "🙂"
    cut = IncrementalDetokenizer(tokenizer)  # a stream that ends inside a character
    assert [cut.push(i) for i in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert cut.flush() == tokenizer.decode(emoji[:-1]) and cut.flush() == ""


def test_token_bytes_for_logprobs(tiny_model_dir: Path) -> None:
    tokenizer = TextTokenizer.from_model_dir(tiny_model_dir)
    text = "héllo 世界 the"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")
    shown = [tokenizer.token_text(i) for i in ids]
    assert any(s.startswith("bytes:\\x") for s in shown)  # a token holding part of a character
    assert tokenizer.token_text(tokenizer.tokenizer.token_to_id("<|im_end|>")) == "<|im_end|>"
    assert tokenizer.token_bytes(500) == b""  # a padded vocabulary row: no text


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_stop_matcher_across_deltas(step: int) -> None:
    text = "alpha beta STOP gamma"
    matcher = StopMatcher(["STOP", "zeta"])
    out = [matcher.push(text[i : i + step]) for i in range(0, len(text), step)] + [matcher.flush()]
    assert "".join(out) == "alpha beta " and matcher.stopped
    matcher = StopMatcher(["never"])
    out = [matcher.push(text[i : i + step]) for i in range(0, len(text), step)] + [matcher.flush()]
    assert "".join(out) == text and not matcher.stopped
    matcher = StopMatcher(["zeta", "STOP"], include=True)
    out = [matcher.push(text[i : i + step]) for i in range(0, len(text), step)] + [matcher.flush()]
    assert "".join(out) == "alpha beta STOP" and matcher.stopped


def test_an_unarmed_stop_matcher_lets_stop_strings_through() -> None:
    matcher = StopMatcher(["ab"])
    assert matcher.push("xab", armed=False) == "xa"
    assert matcher.push("yab") == "by" and matcher.stopped


@pytest.mark.parametrize("step", [1, 3, 100])
def test_reasoning_split(step: int) -> None:
    def split(text: str, starts_in_reasoning: bool) -> tuple[str, str]:
        splitter = ReasoningSplitter(starts_in_reasoning)
        parts = [splitter.push(text[i : i + step]) for i in range(0, len(text), step)] + [splitter.flush()]
        return "".join(r for r, _ in parts), "".join(c for _, c in parts)

    assert split("weigh A and B</think>\n\nAnswer: B", True) == ("weigh A and B", "Answer: B")
    assert split("<think>hmm</think>Answer: C", False) == ("hmm", "Answer: C")
    assert split("no thinking at all", False) == ("", "no thinking at all")
    assert split("cut off while thinking", True) == ("cut off while thinking", "")
    assert split("x</think>y <think>z", True) == ("x", "y <think>z")  # one reasoning block only
    assert ReasoningSplitter.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")


class PoisonableRanks(FakeRanks):
    """The ranks double with an injected decode failure, as a failed rank would report it."""

    def __init__(self) -> None:
        super().__init__(Capacity(kv_pages=64, page_size=16, max_slots=4, max_batch_tokens=64), vocab=384)
        self.model_info = ModelInfo(
            vocab_size=512, eos_token_ids=(2,), max_position_embeddings=512, model_type="fake"
        )
        self.poison_reason: str | None = None
        self.fail = threading.Event()
        self.decode_delay_s = 0.0

    def send(self, command):  # type: ignore[no-untyped-def]
        if isinstance(command, Decode):
            time.sleep(self.decode_delay_s)
            if self.fail.is_set():
                self.poison_reason = "rank 1 failed during decode: injected"
                raise ExecutorPoisoned(self.poison_reason)
        return super().send(command)

    def shutdown(self) -> bool:
        return True


def test_health_is_503_once_poisoned(tiny_model_dir: Path) -> None:
    ranks = PoisonableRanks()
    engine = Engine(ranks, tiny_model_dir)
    try:
        with TestClient(create_app(engine, tiny_model_dir, "tiny")) as http:
            assert http.get("/health").status_code == 200
            ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            ranks.decode_delay_s = 0.01
            body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: {")
                ranks.fail.set()  # the engine fails mid-stream
                rest = [line for line in lines if line]
            assert "injected" in json.loads(rest[-2][len("data: ") :])["error"]["message"]
            assert rest[-1] == "data: [DONE]"
            failed = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert failed.status_code == 503 and "injected" in failed.json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503 and "injected" in health.json()["reason"]
            refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert refused.status_code == 503
            assert "phalanx_engine_poisoned 1.0" in http.get("/metrics").text
    finally:
        engine.shutdown()


def test_a_generation_dropped_before_it_is_read_is_cancelled(tiny_model_dir: Path) -> None:
    ranks = PoisonableRanks()
    ranks.decode_delay_s = 0.02  # 400 tokens would take 8 s
    engine = Engine(ranks, tiny_model_dir)
    try:
        metrics = ServerMetrics(engine.stats, lambda: False, lambda: 0)
        tokenizer = TextTokenizer.from_model_dir(tiny_model_dir)
        params = GenerationParams(max_tokens=400, ignore_eos=True)
        generation = Generation(engine, tokenizer, metrics, [5, 6, 7], params, StopRule())
        _wait(lambda: engine.stats().slots_used == 1)
        del generation
        gc.collect()
        _wait(lambda: engine.stats().slots_used == 0 and engine.stats().running == 0, timeout_s=3.0)
        assert engine.stats().kv_pages_used == 0
    finally:
        engine.shutdown()


def _wait(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_chat_format_separates_reasoning_streamed_and_whole(tiny_model_dir: Path) -> None:
    tokenizer = TextTokenizer.from_model_dir(tiny_model_dir)
    pieces = ["weigh", " it</thi", "nk>\n\nAnswer", ": B"]
    done = Done("stop", 7, 4)

    async def generation() -> AsyncIterator[Chunk | Done]:
        for piece in pieces:
            yield Chunk(piece)
        yield done

    async def stream() -> list[dict]:
        fmt = ChatFormat(tokenizer, "tiny", want_logprobs=False, starts_in_reasoning=True)
        return [chunk async for chunk in fmt.stream_choice(0, [1], generation())]  # type: ignore[arg-type]

    chunks = asyncio.run(stream())
    deltas = [c["delta"] for c in chunks[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "weigh it"
    assert "".join(d.get("content", "") for d in deltas) == "Answer: B"
    assert chunks[-2]["finish_reason"] == "stop" and chunks[-1] == done

    fmt = ChatFormat(tokenizer, "tiny", want_logprobs=False, starts_in_reasoning=True)
    whole = fmt.choice(0, [1, 2], Collected("".join(pieces), [], done))
    assert whole["message"] == {
        "role": "assistant",
        "content": "Answer: B",
        "reasoning_content": "weigh it",
    }


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_tool_call_splitter_across_deltas(step: int) -> None:
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><tool_call>{bad}</tool_call> <tool'
    parser = ToolCallParser()
    content, deltas = [], []
    for i in range(0, len(text), step):
        shown, found = parser.push(text[i : i + step])
        content.append(shown)
        deltas += found
    shown, found = parser.push("", end=True)
    content.append(shown)
    calls = whole_calls(deltas + found)
    assert "".join(content) == "Sure. <tool_call>{bad}</tool_call> <tool"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1})
    ]


def test_chat_choice_keeps_only_the_first_call_without_parallel_tool_calls(tiny_model_dir: Path) -> None:
    tokenizer = TextTokenizer.from_model_dir(tiny_model_dir)
    call = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>'
    result = Collected(call % "a" + call % "b", [], Done("stop", 3, 9))
    fmt = ChatFormat(
        tokenizer, "tiny", want_logprobs=False, parses_tool_calls=True, parallel_tool_calls=False
    )
    choice = fmt.choice(0, [1], result)
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["a"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None


def test_an_unexpected_server_failure_is_a_500_in_openai_shape(tiny_model_dir: Path) -> None:
    engine = Engine(PoisonableRanks(), tiny_model_dir)
    try:
        app = create_app(engine, tiny_model_dir, "tiny")

        def broken() -> None:  # the injected fault: a handler that fails
            raise RuntimeError("injected")

        app.add_api_route("/v1/broken", broken)
        with TestClient(app, raise_server_exceptions=False) as http:
            response = http.get("/v1/broken")
            assert response.status_code == 500
            assert response.json()["error"] == {
                "message": "internal error in GET /v1/broken: RuntimeError: injected",
                "type": "server_error",
                "param": None,
                "code": None,
            }
            assert http.get("/health").status_code == 200
    finally:
        engine.shutdown()
