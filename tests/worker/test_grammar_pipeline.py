"""Constrained requests in pipelined decode on one rank: their picks reach the matchers only when
the next mask is built, after the next step is launched, and still give exactly the tokens of
steps fed explicitly, through the drop of a constrained request whose pick was not yet fed."""

from __future__ import annotations

from pathlib import Path

import llguidance
import pytest
import torch

from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    FED_TOKEN,
    DecodeRow,
    DropRequest,
    Expectation,
    PrefillChunk,
    SamplingParams,
    SlotMove,
)
from phalanx.worker.commands import StepRunner
from phalanx.worker.grammar import GrammarTable
from tests.worker.test_pipelined_steps import PROMPTS, _pages
from tests.worker.test_pipelined_steps import _rank as _plain_rank

GRAMMAR = llguidance.LLMatcher.grammar_from_regex(r"[a-z]{2,6}( [a-z]{2,6}){0,5}\.")
SAMPLING = [  # request 1 has no grammar
    SamplingParams(temperature=1.0, seed=5),
    SamplingParams(),
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=9),
]
CONSTRAINED = (0, 2, 3)
STEPS, DROP_AT = 16, 6  # request 2 retires at DROP_AT, request 3 moves into its slot


def _rank(model_dir: Path, graphs: bool) -> StepRunner:
    rank = _plain_rank(model_dir, torch.device("cpu"), graphs)
    config = rank.model.config
    rank.grammars = GrammarTable(model_dir, config.vocab_size, config.eos_token_ids)
    return rank


def _generate(rank: StepRunner, pipelined: bool) -> dict[int, list[int]]:
    """Every request's tokens. Pipelined: each step is launched before the one ahead is read,
    except the first after the drop, which feeds the tokens read before it."""
    chunks = [
        PrefillChunk(
            r, pack_ids(p), 0, _pages(r), True, SAMPLING[r], grammar=GRAMMAR if r in CONSTRAINED else None
        )
        for r, p in enumerate(PROMPTS)
    ]
    tokens = {result.request_id: [result.token] for result in rank.prefill(chunks).results}
    slot_of = {r: r for r in range(len(PROMPTS))}
    ahead = None

    def read_ahead() -> None:
        for result in ahead.results():
            tokens[result.request_id].append(result.token)

    for step in range(STEPS):
        if step == DROP_AT:  # request 2's last pick is still unfed to its matcher
            if ahead is not None:
                read_ahead()
                ahead = None
            rank.drop(DropRequest(2, Expectation.MUST_EXIST, SlotMove(3, 3, 2)))
            slot_of = {0: 0, 1: 1, 3: 2}
        fed = pipelined and ahead is not None
        rows = [
            DecodeRow(
                r, slot, FED_TOKEN if fed else tokens[r][-1], len(PROMPTS[r]) + step, _pages(r), SAMPLING[r]
            )
            for r, slot in slot_of.items()
        ]
        launched = rank.decode(rows)
        if ahead is not None:
            read_ahead()
        ahead = launched
        if not pipelined:
            read_ahead()
            ahead = None
    if ahead is not None:
        read_ahead()
    return tokens


def _follows_the_grammar(model_dir: Path, config, tokens: list[int]) -> bool:
    text = (model_dir / "tokenizer.json").read_text()
    tokenizer = llguidance.LLTokenizer(text, n_vocab=config.vocab_size, eos_token=list(config.eos_token_ids))
    matcher = llguidance.LLMatcher(tokenizer, GRAMMAR)
    return all(matcher.is_stopped() or matcher.consume_token(token) for token in tokens)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_pipelined_constrained_steps_give_the_tokens_of_steps_fed_explicitly(
    tiny_model_dir: Path, graphs: bool
) -> None:
    explicit_rank = _rank(tiny_model_dir, graphs)
    explicit = _generate(explicit_rank, pipelined=False)
    pipelined = _generate(_rank(tiny_model_dir, graphs), pipelined=True)
    assert pipelined == explicit
    assert [len(explicit[r]) for r in range(len(PROMPTS))] == [1 + STEPS, 1 + STEPS, 1 + DROP_AT, 1 + STEPS]
    eos = set(explicit_rank.model.config.eos_token_ids)
    for request in CONSTRAINED:
        assert _follows_the_grammar(tiny_model_dir, explicit_rank.model.config, explicit[request])
    assert any(token in eos for token in explicit[0] + explicit[3])  # a grammar ran to its end
