"""A request's own values that one rank judges (``worker/step_plans.py``), in process on the
tiny model: the request is rejected alone, its chunk or row runs with harmless values in place, and
its rank state stays what the command would have left."""

from __future__ import annotations

from pathlib import Path

import msgspec

from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.messages import (
    FED_TOKEN,
    DropRequest,
    Expectation,
    RequestRejected,
    SamplingParams,
)
from phalanx.worker.commands import StepRunner
from phalanx.worker.grammar import GrammarTable
from phalanx.worker.request_table import Phase
from tests.support.step_runner import decode_row, new_runner, prefill_chunk, prefilled_runner

VOCAB = 512  # the tiny model's
OUTSIDE = "is outside the vocabulary [0, 512)"


def test_a_prompt_token_outside_the_vocabulary_rejects_its_request_alone(runner: StepRunner) -> None:
    done = runner.prefill([prefill_chunk(1, [4, 600, 6], 0, [0]), prefill_chunk(2, [7, 8], 0, [1])])
    assert done.rejected == [RequestRejected(1, f"prompt token id 600 {OUTSIDE} (position 1)")]
    assert [result.request_id for result in done.results] == [2]
    state = runner.requests.require(1, "test")
    assert (state.phase, state.cached) == (Phase.PREFILLED, 3)  # it ran, with token 0 in place
    assert runner.drop(DropRequest(1, Expectation.MUST_EXIST)) is True


def test_the_first_bad_value_of_a_chunk_is_named(runner: StepRunner) -> None:
    bias = SamplingParams(logit_bias={700: 1.0, 3: 2.0})
    chunk = msgspec.structs.replace(
        prefill_chunk(1, [4, 5], 0, [0], last=False), next_token=-5, sampling=bias
    )
    assert runner.prefill([chunk]).rejected == [
        RequestRejected(1, f"prompt token id -5 {OUTSIDE} (position 2)")
    ]
    banned = SamplingParams(banned_ids=[2, VOCAB], banned_until=9)
    last = msgspec.structs.replace(prefill_chunk(1, [6], 2, [0]), sampling=banned)
    done = runner.prefill([last])
    assert done.rejected == [RequestRejected(1, f"a banned token id 512 {OUTSIDE}")] and done.results == []


def test_a_decode_row_is_judged_at_every_step_and_a_fed_row_follows_a_rejected_one(
    model: Qwen35Model,
) -> None:
    runner, firsts = prefilled_runner(model, [[4, 5, 6], [7, 8]])
    bad_bias = SamplingParams(logit_bias={VOCAB + 1: 5.0})
    rows = [
        decode_row(1, 0, 3, [0, 1], token=VOCAB),
        msgspec.structs.replace(decode_row(2, 1, 2, [2, 3], firsts[1]), sampling=bad_bias),
    ]
    done = runner.decode(rows).reply()
    assert done.rejected == [
        RequestRejected(1, f"decode token id 512 {OUTSIDE} (position 3)"),
        RequestRejected(2, f"logit_bias token id 513 {OUTSIDE}"),
    ]
    assert done.results == [] and runner.fed_tokens.max() < VOCAB
    # The next step was sent before the rejections were read: request 1's fed row is served,
    # request 2's keeps its bad bias and is rejected again.
    fed = [
        decode_row(1, 0, 4, [0, 1], token=FED_TOKEN),
        msgspec.structs.replace(rows[1], token=FED_TOKEN, position=3),
    ]
    done = runner.decode(fed).reply()
    assert [result.request_id for result in done.results] == [1]
    assert done.rejected == [RequestRejected(2, f"logit_bias token id 513 {OUTSIDE}")]
    for request_id, slot in ((1, 0), (2, 1)):
        assert runner.requests.require(request_id, "test").decode_slot == slot


def test_a_grammar_rank_0_cannot_compile_rejects_its_request_and_keeps_no_matcher(
    model: Qwen35Model, tiny_model_dir: Path
) -> None:
    runner = new_runner(model)
    runner.grammars = GrammarTable(tiny_model_dir, model.config.vocab_size, model.config.eos_token_ids)
    chunk = msgspec.structs.replace(prefill_chunk(1, [4, 5], 0, [0]), grammar="(")
    (rejected,) = runner.prefill([chunk, prefill_chunk(2, [6], 0, [1])]).rejected
    assert rejected.request_id == 1
    assert rejected.reason.startswith("grammar does not compile: 1(1): expecting rule, token or statement")
    assert 1 not in runner.grammars
    assert runner.requests.require(1, "test").phase is Phase.PREFILLED
