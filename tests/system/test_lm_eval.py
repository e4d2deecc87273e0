"""lm-evaluation-harness end to end against a live ``phalanx serve`` (TP 2, CPU) on the tiny model:
its ``local-completions`` loglikelihood path (batched token-id prompts, echo, logprobs) and its
``local-chat-completions`` generate path, on small tasks written here (nothing downloaded). The
loglikelihoods lm-eval reports equal transformers' on the same token ids (fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.live_server import MODEL_NAME

QUESTIONS = [
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Cats say", "choices": [" meow", " woof", " moo", " quack"], "answer": 0},
]
PROMPTS = [{"question": "Say hello", "answer": "hello"}, {"question": "Count to three", "answer": "1 2 3"}]


@pytest.fixture(scope="module")
def base_url(tiny_server: str) -> str:
    return tiny_server


def _tasks(root: Path) -> Path:
    """A multiple-choice task and a generation task over local JSON lines."""
    (root / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (root / "gen.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (root / "phalanx_mc.yaml").write_text(
        f"""task: phalanx_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
    )
    (root / "phalanx_gen.yaml").write_text(
        f"""task: phalanx_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  temperature: 0
metric_list:
  - metric: exact_match
"""
    )
    return root


def _transformers_loglikelihood(model: Any, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return sum(logprobs[len(context) + i - 1, token].item() for i, token in enumerate(continuation))


def _task_manager(root: Path) -> Any:
    """Only the tasks written here: indexing lm-eval's built-in tasks as well takes seconds."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(_tasks(root)), include_defaults=False)


def test_local_completions_loglikelihoods_equal_transformers(
    base_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm = LocalCompletionsAPI(
        base_url=base_url + "/v1/completions",
        model=MODEL_NAME,
        tokenizer=str(tiny_model_dir),
        tokenizer_backend="huggingface",
        batch_size=4,  # several prompts in one request
        max_retries=1,
    )
    out = simple_evaluate(model=lm, tasks=["phalanx_mc"], task_manager=_task_manager(tmp_path))
    samples = out["samples"]["phalanx_mc"]
    assert len(samples) == len(QUESTIONS)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pairs = [(args, resp) for s in samples for args, resp in zip(s["arguments"], s["resps"], strict=True)]
    assert len(pairs) == sum(len(q["choices"]) for q in QUESTIONS)
    for (context, continuation), [(loglikelihood, _greedy)] in pairs:
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        expected = _transformers_loglikelihood(model, context_ids, continuation_ids)
        assert loglikelihood == pytest.approx(expected, abs=1e-4)


def test_local_chat_completions_generates(
    base_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalChatCompletion

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm = LocalChatCompletion(base_url=base_url + "/v1/chat/completions", model=MODEL_NAME, max_retries=1)
    out = simple_evaluate(
        model=lm,
        tasks=["phalanx_gen"],
        task_manager=_task_manager(tmp_path),
        apply_chat_template=True,
    )
    samples = out["samples"]["phalanx_gen"]
    assert len(samples) == len(PROMPTS)
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in samples)
    assert "exact_match,none" in out["results"]["phalanx_gen"]
