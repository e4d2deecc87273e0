"""Rank 0's grammar table and a constrained request through a rank's prefill and decode, on the
tiny model (random weights: only the grammar makes the output well-formed)."""

from __future__ import annotations

from pathlib import Path

import llguidance
import pytest
import torch

from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import DecodeRow, DropRequest, Expectation, PrefillChunk, SamplingParams
from phalanx.server.detokenizer import TextTokenizer
from phalanx.worker.commands import StepRunner
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.grammar import GrammarTable

ANSWERS = ("yes", "no", "maybe")


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Qwen35Model:
    return Qwen35Model.load(tiny_model_dir, rank=0, world_size=1, device=torch.device("cpu"))


def _table(model: Qwen35Model, model_dir: Path) -> GrammarTable:
    return GrammarTable(model_dir, model.config.vocab_size, model.config.eos_token_ids)


def test_masks_follow_the_grammar_then_allow_only_the_end(model: Qwen35Model, tiny_model_dir: Path) -> None:
    table = _table(model, tiny_model_dir)
    table.start(7, llguidance.LLMatcher.grammar_from_regex("yes|no|maybe"))
    tokenizer = TextTokenizer.from_model_dir(tiny_model_dir)
    picked: list[int] = []
    for _ in range(10):
        allowed = table.allowed([3, 7], torch.device("cpu"))
        assert allowed is not None and allowed[0].all()  # request 3 has no grammar
        ids = allowed[1].nonzero().flatten().tolist()
        if set(ids) <= set(model.config.eos_token_ids):
            break
        assert max(ids) < tokenizer.tokenizer.get_vocab_size()  # padded rows never
        picked.append(ids[-1])
        table.advance([3, 7], [0, ids[-1]])
    assert tokenizer.decode(picked) in ANSWERS
    assert table.allowed([3], torch.device("cpu")) is None
    table.drop(7)
    assert 7 not in table


def test_a_token_the_grammar_refuses_is_a_state_error(model: Qwen35Model, tiny_model_dir: Path) -> None:
    table = _table(model, tiny_model_dir)
    table.start(1, llguidance.LLMatcher.grammar_from_regex("a+"))
    refused = TextTokenizer.from_model_dir(tiny_model_dir).encode("z", add_special_tokens=False)[0]
    with pytest.raises(
        WorkerStateError, match=f"^request 1 picked token {refused}, which its grammar does not allow"
    ):
        table.advance([1], [refused])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_request_through_prefill_and_decode(
    model: Qwen35Model, tiny_model_dir: Path, temperature: float
) -> None:
    model.allocate_cache(17, 4, 6)
    runner = StepRunner(model, torch.device("cpu"), 0, 4, 16, 3, 64)
    runner.grammars = _table(model, tiny_model_dir)
    sampling = SamplingParams(temperature=temperature, seed=3)
    grammar = llguidance.LLMatcher.grammar_from_regex("yes|no|maybe")
    chunk = PrefillChunk(1, pack_ids([5, 6, 7]), 0, pack_ids([0, 1, 2, 3]), True, sampling, grammar=grammar)
    tokens = [runner.prefill([chunk]).results[0].token]
    eos = set(model.config.eos_token_ids)
    while tokens[-1] not in eos and len(tokens) < 10:
        row = DecodeRow(1, 0, tokens[-1], 2 + len(tokens), pack_ids([0, 1, 2, 3]), sampling)
        tokens.append(runner.decode([row]).results()[0].token)
    assert tokens[-1] in eos
    assert TextTokenizer.from_model_dir(tiny_model_dir).decode(tokens[:-1]) in ANSWERS
    runner.drop(DropRequest(1, Expectation.MUST_EXIST))
    assert 1 not in runner.grammars
