"""One rank's checks and execution of the step commands, in process, with the real tiny model."""

from __future__ import annotations

import pytest
import torch

from phalanx.models.qwen35 import PrefillBatch, Qwen35Model
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    FED_TOKEN,
    DecodeRow,
    DropRequest,
    Expectation,
    PrefillChunk,
    SlotMove,
)
from phalanx.worker.commands import StepRunner
from phalanx.worker.errors import WorkerStateError
from tests.support.step_runner import (
    KV_PAGES,
    MAX_SLOTS,
    PAGE,
    decode_row,
    prefill_chunk,
    prefilled_runner,
)


def test_phase_and_position_checks(runner: StepRunner) -> None:
    with pytest.raises(WorkerStateError, match="^decode request 5 has no worker state$"):
        runner.decode([decode_row(5, 0, 0, [0])])
    assert runner.prefill([prefill_chunk(1, [4, 5, 6], 0, [0], last=False)]).results == []
    with pytest.raises(WorkerStateError, match="^request 1 is not ready for decode$"):
        runner.decode([decode_row(1, 0, 3, [0])])
    with pytest.raises(
        WorkerStateError, match="^prefill chunk for request 1 starts at 2 but 3 tokens are cached$"
    ):
        runner.prefill([prefill_chunk(1, [7], 2, [0])])
    (result,) = runner.prefill([prefill_chunk(1, [7, 8], 3, [0, 1])]).results
    assert result.request_id == 1
    with pytest.raises(WorkerStateError, match="^request 1 is already in prefilled state$"):
        runner.prefill([prefill_chunk(1, [9], 5, [0, 1])])
    with pytest.raises(
        WorkerStateError, match="^decode row of request 1 is at position 4 but 5 tokens are cached$"
    ):
        runner.decode([decode_row(1, 0, 4, [0, 1])])
    with pytest.raises(
        WorkerStateError, match="^page table of request 2 has 1 pages; 2 are needed for 5 tokens$"
    ):
        runner.prefill([prefill_chunk(2, [1, 2, 3, 4, 5], 0, [2])])


def test_slot_admission_moves_and_drops(runner: StepRunner) -> None:
    runner.prefill(
        [prefill_chunk(1, [4, 5], 0, [0]), prefill_chunk(2, [6], 0, [1]), prefill_chunk(3, [7, 8, 9], 0, [2])]
    )
    assert [state.staging_slot for state in runner.requests.requests.values()] == [3, 4, 5]
    runner.decode([decode_row(1, 0, 2, [0]), decode_row(2, 1, 1, [1])])
    with pytest.raises(
        WorkerStateError, match="^decode slot 1 still owned by request 2 at admission of request 3$"
    ):
        runner.decode([decode_row(3, 1, 3, [2])])
    with pytest.raises(
        WorkerStateError, match="^decode row of request 1 carries slot 2 but the request lives in slot 0$"
    ):
        runner.decode([decode_row(1, 2, 3, [0])])
    with pytest.raises(WorkerStateError, match="^drop of absent request 9 carries a slot compaction$"):
        runner.drop(DropRequest(9, Expectation.MUST_EXIST, SlotMove(2, 1, 0)))
    with pytest.raises(
        WorkerStateError, match="^request 2 lives in slot 1 but the scheduler dropped it from slot 0$"
    ):
        runner.drop(DropRequest(2, Expectation.MUST_EXIST, SlotMove(3, 1, 0)))
    with pytest.raises(
        WorkerStateError, match="^request 1 lives in slot 0 but the scheduler moved it from slot 1$"
    ):
        runner.drop(DropRequest(3, Expectation.MUST_EXIST, SlotMove(1, 1, 2)))
    # Drop request 1 (slot 0); request 2 moves 1 -> 0; request 3 never took a slot.
    assert runner.drop(DropRequest(1, Expectation.MUST_EXIST, SlotMove(2, 1, 0))) is True
    assert runner.slots.owners == [2, None, None]
    assert runner.requests.requests[2].decode_slot == 0
    assert runner.drop(DropRequest(1, Expectation.MUST_BE_ABSENT)) is False
    assert runner.drop(DropRequest(3, Expectation.MUST_EXIST)) is True
    assert runner.drop(DropRequest(2, Expectation.MUST_EXIST)) is True
    assert runner.slots.owners == [None, None, None] and len(runner.requests) == 0


def test_fed_rows_decode_the_tokens_sampled_in_the_step_before(model: Qwen35Model) -> None:
    prompts = [[4, 5], [6, 7, 8]]

    def rows(tokens: list[int], step: int) -> list[DecodeRow]:
        return [
            decode_row(i + 1, i, len(p) + step, [2 * i, 2 * i + 1], token=t)
            for i, (p, t) in enumerate(zip(prompts, tokens, strict=True))
        ]

    explicit, tokens = prefilled_runner(model, prompts)
    told = []
    for step in range(3):
        tokens = [r.token for r in explicit.decode(rows(tokens, step)).results()]
        told.append(tokens)
    fed, first = prefilled_runner(model, prompts)
    steps = [fed.decode(rows(first, 0))]
    for step in (1, 2):
        steps.append(fed.decode(rows([FED_TOKEN] * 2, step)))
    assert [[r.token for r in s.results()] for s in steps] == told


def test_a_unified_steps_fed_rows_decode_the_tokens_of_the_decode_before(model: Qwen35Model) -> None:
    """A pipelined Unified: request 2's prompt beside request 1's row fed from the Decode before;
    the same tokens as with request 1's token told."""
    explicit, (token,) = prefilled_runner(model, [[4, 5]])
    second = explicit.decode([decode_row(1, 0, 2, [0, 1], token=token)]).results()[0].token
    told = explicit.unified(
        [prefill_chunk(2, [6, 7], 0, [2, 3])], [decode_row(1, 0, 3, [0, 1], token=second)]
    ).reply()
    fed, (token,) = prefilled_runner(model, [[4, 5]])
    fed.decode([decode_row(1, 0, 2, [0, 1], token=token)])
    reply = fed.unified(
        [prefill_chunk(2, [6, 7], 0, [2, 3])], [decode_row(1, 0, 3, [0, 1], token=FED_TOKEN)]
    ).reply()
    assert reply == told and len(reply.prefill) == 1 and len(reply.decode) == 1


def test_a_fed_row_needs_a_decode_of_its_request_in_the_command_before(model: Qwen35Model) -> None:
    runner, (token_1, token_2) = prefilled_runner(model, [[4, 5], [6]])
    text = "^decode row of request {} feeds the token sampled by the previous command, which did not decode the request in slot {}$"
    with pytest.raises(WorkerStateError, match=text.format(1, 0)):
        runner.decode([decode_row(1, 0, 2, [0, 1], token=FED_TOKEN)])  # the command before was a prefill
    runner, (token_1, token_2) = prefilled_runner(model, [[4, 5], [6]])
    runner.decode([decode_row(1, 0, 2, [0, 1], token=token_1)]).results()
    with pytest.raises(WorkerStateError, match=text.format(2, 1)):
        runner.decode(
            [decode_row(1, 0, 3, [0, 1], token=FED_TOKEN), decode_row(2, 1, 1, [2, 3], token=FED_TOKEN)]
        )
    runner, (token_1, token_2) = prefilled_runner(model, [[4, 5], [6]])
    runner.decode(
        [decode_row(1, 0, 2, [0, 1], token=token_1), decode_row(2, 1, 1, [2, 3], token=token_2)]
    ).results()
    assert runner.drop(DropRequest(2, Expectation.MUST_EXIST)) is True
    with pytest.raises(WorkerStateError, match=text.format(1, 0)):
        runner.decode([decode_row(1, 0, 3, [0, 1], token=FED_TOKEN)])  # a drop came between


def test_a_prefill_feeds_the_first_decode_from_the_slot_its_last_chunk_names(model: Qwen35Model) -> None:
    prompts = [[4, 5], [6, 7, 8]]
    explicit, first = prefilled_runner(model, prompts)
    rows = [
        decode_row(i + 1, i, len(p), [2 * i, 2 * i + 1], token=t)
        for i, (p, t) in enumerate(zip(prompts, first, strict=True))
    ]
    told = [r.token for r in explicit.decode(rows).results()]
    model.allocate_cache(KV_PAGES + 1, PAGE, 2 * MAX_SLOTS)
    fed = StepRunner(model, torch.device("cpu"), 0, PAGE, KV_PAGES, MAX_SLOTS, 64)
    chunks = [
        PrefillChunk(i + 1, pack_ids(p), 0, pack_ids([2 * i, 2 * i + 1]), True, feed_slot=i)
        for i, p in enumerate(prompts)
    ]
    assert [r.token for r in fed.prefill(chunks).results] == first
    assert fed.fed_tokens[:2].tolist() == first
    fed_rows = [
        decode_row(i + 1, i, len(p), [2 * i, 2 * i + 1], token=FED_TOKEN) for i, p in enumerate(prompts)
    ]
    assert [r.token for r in fed.decode(fed_rows).results()] == told


def test_a_prefill_feeds_only_a_free_slot_from_a_last_chunk(model: Qwen35Model) -> None:
    runner, (token_1, _) = prefilled_runner(model, [[4, 5], [6]])
    runner.decode([decode_row(1, 0, 2, [0, 1], token=token_1)]).results()
    where = "^prefill chunk for request 3 feeds slot {}"
    cases = [
        (
            PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), False, feed_slot=1),
            " but is not its prompt's last chunk$",
        ),
        (PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), True, feed_slot=0), ", which request 1 holds$"),
        (
            PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), True, feed_slot=3),
            " outside the worker slot map of 3$",
        ),
    ]
    for chunk, end in cases:
        with pytest.raises(WorkerStateError, match=where.format(chunk.feed_slot) + end):
            runner.prefill([chunk])
        runner.requests.remove(3)  # the refused chunk began the request's state: forget it
    with pytest.raises(
        WorkerStateError,
        match="^unified chunk for request 3 feeds slot 1: only a prefill may feed a decode slot$",
    ):
        runner.unified([PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), True, feed_slot=1)], [])


@pytest.mark.parametrize("score_rows", [512, 2], ids=["rows-at-once", "rows-two-at-a-time"])
def test_prompt_logprobs_of_a_chunked_prompt_match_the_full_logits(
    model: Qwen35Model, score_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("phalanx.models.qwen35.parallel.SCORE_ROWS", score_rows)
    prompt = [4, 5, 6, 7, 8, 9, 10]
    model.allocate_cache(KV_PAGES + 1, PAGE, 2 * MAX_SLOTS)
    full = model.prefill(PrefillBatch.build([(prompt, 0, MAX_SLOTS, [0, 1])]), all_logits=True)
    reference = torch.log_softmax(full, dim=-1)
    runner = StepRunner(model, torch.device("cpu"), 0, PAGE, KV_PAGES, MAX_SLOTS, 64)
    first = PrefillChunk(1, pack_ids(prompt[:3]), 0, pack_ids([0]), False, prompt_logprobs=2, next_token=7)
    second = PrefillChunk(1, pack_ids(prompt[3:]), 3, pack_ids([0, 1]), True, prompt_logprobs=2)
    head, tail = runner.prefill([first]).prompt_logprobs, runner.prefill([second]).prompt_logprobs
    assert [(p.request_id, p.start, len(p.logprobs)) for p in (*head, *tail)] == [(1, 1, 3), (1, 4, 3)]
    scored = [*head[0].logprobs, *tail[0].logprobs]
    expected = [reference[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert scored == pytest.approx(expected, abs=1e-5)
    ranks = [int((reference[i] > reference[i, prompt[i + 1]]).sum()) + 1 for i in range(len(prompt) - 1)]
    assert [*head[0].ranks, *tail[0].ranks] == ranks
    top = reference.topk(2, dim=-1)
    assert [*head[0].top_ids, *tail[0].top_ids] == top.indices[:-1].tolist()
    top_logprobs = [value for row in (*head[0].top_logprobs, *tail[0].top_logprobs) for value in row]
    assert top_logprobs == pytest.approx(top.values[:-1].flatten().tolist(), abs=1e-5)


def test_a_prompt_logprobs_chunk_with_a_wrong_next_token_is_refused(runner: StepRunner) -> None:
    chunk = PrefillChunk(1, pack_ids([4, 5]), 0, pack_ids([0]), True, prompt_logprobs=0, next_token=7)
    with pytest.raises(
        WorkerStateError, match="^prefill chunk for request 1: next_token 7 does not match last=True$"
    ):
        runner.prefill([chunk])
