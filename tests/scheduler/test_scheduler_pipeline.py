"""Pipelined decode against a test double of the ranks (tests/support/fake_ranks.py): each step
is sent before the last one is read, its rows fed from their slots, a prefill's first decodes
follow it unread, new requests and prompt chunks ride along in unified steps, and a stop or a
cancellation reads the steps in flight first."""

from __future__ import annotations

import pytest

from phalanx.protocol.messages import FED_TOKEN, NO_FEED, Expectation
from phalanx.scheduler.events import ErrorEvent
from phalanx.scheduler.requests import Request
from phalanx.scheduler.scheduler import Scheduler
from tests.support.fake_ranks import FakeRanks
from tests.support.scheduler_driver import Sink, assert_pools_full, make, pipelined, run, submit


def test_pipelined_decode_sends_each_step_before_reading_the_last() -> None:
    _, sched = make()
    _, alone = submit(sched, [4, 5], max_tokens=12, ignore_eos=True)
    run(sched)
    ranks, sched = make(pipeline=True)
    request, sink = submit(sched, [4, 5], max_tokens=12, ignore_eos=True)
    run(sched)
    assert sink.tokens == alone.tokens and sink.finish.reason == "length"
    decodes = [rows for kind, rows in ranks.commands if kind == "decode"]
    # Every decode is sent before the step ahead of it is read, so it feeds what the ranks
    # sampled: the first one the prefill's token, which its chunk kept for slot 0. The last step
    # is never continued.
    assert [kind for kind, _ in ranks.commands[:2]] == ["prefill", "decode"]
    assert [chunk.feed_slot for chunk in ranks.commands[0][1]] == [0]
    assert [row.token == FED_TOKEN for (row,) in decodes] == [True] * 11
    assert [row.position for (row,) in decodes] == list(range(2, 13))
    assert ranks.most_in_flight == 2
    assert ranks.commands[-1] == ("drop", (request.request_id, Expectation.MUST_EXIST, None))
    assert_pools_full(ranks, sched)


def test_pipelined_eos_reads_the_step_behind_and_discards_its_token() -> None:
    _, sched = make()
    _, probe = submit(sched, [8, 9], max_tokens=10, ignore_eos=True)
    _, other = submit(sched, [1], max_tokens=10, ignore_eos=True)
    run(sched)
    eos = probe.tokens[4]
    ranks, sched = make(eos=(eos,), pipeline=True)
    stopped, stopped_sink = submit(sched, [8, 9], max_tokens=10)
    _, going = submit(sched, [1], max_tokens=10, ignore_eos=True)
    run(sched)
    assert stopped_sink.tokens == probe.tokens[:5] and stopped_sink.finish.reason == "stop"
    assert going.tokens == other.tokens and going.finish.reason == "length"
    # The step after the EOS still carried the stopped request; then it was dropped.
    decodes = [rows for kind, rows in ranks.commands if kind == "decode"]
    fed_stopped = [row.position for rows in decodes for row in rows if row.request_id == stopped.request_id]
    assert fed_stopped == [2, 3, 4, 5, 6]  # positions 2..5 made its tokens 2..5; position 6 was discarded
    assert_pools_full(ranks, sched)


def test_the_first_decodes_follow_their_prefill_unread_fed_from_their_slots() -> None:
    _, sched = make()
    _, first_alone = submit(sched, [4, 5], max_tokens=6, ignore_eos=True)
    _, second_alone = submit(sched, [7], max_tokens=6, ignore_eos=True)
    run(sched)
    ranks, sched = make(pipeline=True)
    _, first = submit(sched, [4, 5], max_tokens=6, ignore_eos=True)
    _, second = submit(sched, [7], max_tokens=6, ignore_eos=True)
    sched.step()  # the prefill, then the first decode behind it: nothing read yet
    kinds = [kind for kind, _ in ranks.commands]
    assert kinds == ["prefill", "decode"] and ranks.most_in_flight == 2
    assert [chunk.feed_slot for chunk in ranks.commands[0][1]] == [0, 1]
    assert [(row.slot, row.token) for row in ranks.commands[1][1]] == [(0, FED_TOKEN), (1, FED_TOKEN)]
    assert first.tokens == [] and second.tokens == []
    run(sched)
    assert first.tokens == first_alone.tokens and second.tokens == second_alone.tokens
    assert_pools_full(ranks, sched)


def test_a_prefill_token_that_stops_its_request_discards_the_decode_behind_it() -> None:
    _, sched = make()
    _, probe = submit(sched, [8, 9], max_tokens=10, ignore_eos=True)
    run(sched)
    ranks, sched = make(eos=(probe.tokens[0],), pipeline=True)
    stopped, sink = submit(sched, [8, 9], max_tokens=10)
    run(sched)
    assert sink.tokens == probe.tokens[:1] and sink.finish.reason == "stop"
    assert [kind for kind, _ in ranks.commands] == ["prefill", "decode", "drop"]
    # The decode sent behind the prefill ran (the request holds slot 0 on the ranks); its token
    # is dropped with the request.
    assert ranks.commands[-1] == ("drop", (stopped.request_id, Expectation.MUST_EXIST, None))
    assert_pools_full(ranks, sched)


def test_a_cancellation_after_a_pipelined_prefill_reads_both_steps_first() -> None:
    ranks, sched = make(pipeline=True)
    request, sink = submit(sched, [2, 3], max_tokens=8, ignore_eos=True)
    sched.step()  # prefill + first decode in flight
    sched.cancel(request.request_id)
    run(sched)
    assert len(sink.tokens) == 2 and sink.finish.reason == "cancelled"
    assert [kind for kind, _ in ranks.commands] == ["prefill", "decode", "drop"]
    assert_pools_full(ranks, sched)


@pytest.mark.parametrize(
    "case", ["one token", "a waiting request", "a prompt in chunks"], ids=lambda case: case.replace(" ", "_")
)
def test_a_prefill_is_read_before_any_decode_when_its_requests_cannot_all_decode_next(case: str) -> None:
    ranks, sched = make(pipeline=True, max_slots=1 if case == "a waiting request" else 4)
    prompt = list(range(1, 21)) if case == "a prompt in chunks" else [3, 4]  # 20 tokens: 16, then 4
    submit(sched, prompt, max_tokens=1 if case == "one token" else 5, ignore_eos=True)
    if case == "a waiting request":
        submit(sched, [5], max_tokens=2, ignore_eos=True)  # no slot is left for it
    sched.step()  # the prefill, read at once: no decode behind it
    assert [kind for kind, _ in ranks.commands] == (
        ["prefill", "drop"] if case == "one token" else ["prefill"]
    )
    assert [chunk.feed_slot for chunk in ranks.commands[0][1]] == [NO_FEED]
    run(sched)
    if case != "one token":  # a prompt's last chunk, or the waiting request once alone, feeds
        last = [chunks for kind, chunks in ranks.commands if kind == "prefill"][-1]
        assert [chunk.feed_slot for chunk in last] == [0]
    assert_pools_full(ranks, sched)


def _pipelining(ticks: int) -> tuple[FakeRanks, Scheduler, Request, Sink]:
    """A pipelined scheduler ``ticks`` ticks into one request of 20 tokens."""
    ranks, sched = make(pipeline=True)
    request, sink = submit(sched, [1, 2], max_tokens=20, ignore_eos=True)
    for _ in range(ticks):
        sched.step()
    assert ranks.commands[-1][0] == "decode" and ranks.most_in_flight == 2
    return ranks, sched, request, sink


def test_a_new_request_rides_along_the_pipeline_in_a_unified_step_then_joins_it() -> None:
    """A request that arrives while the pipeline runs does not stop it: its prompt goes out in a
    Unified sent behind the step in flight, beside that step's fed rows, and once that Unified is
    read its request joins the next step with its first token (the others still fed)."""
    ranks, sched = make()
    _, first_alone = submit(sched, [1, 2], max_tokens=20, ignore_eos=True)
    _, second_alone = submit(sched, [3], max_tokens=3, ignore_eos=True)
    run(sched)
    ranks, sched, first_request, first = _pipelining(4)
    second_request, second = submit(sched, [3], max_tokens=3, ignore_eos=True)
    sent = len(ranks.commands)
    sched.step()  # the Unified goes out before the step in flight is read
    kind, (chunks, rows) = ranks.commands[sent]
    assert kind == "unified" and [chunk.request_id for chunk in chunks] == [second_request.request_id]
    assert [(row.slot, row.token) for row in rows] == [(0, FED_TOKEN)]
    assert ranks.most_in_flight == 2
    sched.step()  # the decode behind the Unified: the first request fed, the new one not yet ready
    kind, rows = ranks.commands[sent + 1]
    assert kind == "decode" and [(row.slot, row.token) for row in rows] == [(0, FED_TOKEN)]
    sched.step()  # the Unified was read: the new request joins with its first token
    kind, rows = ranks.commands[sent + 2]
    assert kind == "decode" and [row.request_id for row in rows] == [
        first_request.request_id,
        second_request.request_id,
    ]
    assert rows[0].token == FED_TOKEN and rows[1].token == second.tokens[0] == second_alone.tokens[0]
    run(sched)
    assert first.tokens == first_alone.tokens and second.tokens == second_alone.tokens
    assert ranks.most_in_flight == 2
    assert_pools_full(ranks, sched)


def test_a_prompt_in_chunks_rides_along_the_pipeline_one_chunk_a_step() -> None:
    ranks, sched = make()
    long_prompt = list(range(1, 21))  # 20 tokens, over the 16-token budget with a decode row
    _, alone = submit(sched, long_prompt, max_tokens=4, ignore_eos=True)
    run(sched)
    ranks, sched, _, first = _pipelining(4)
    _, second = submit(sched, long_prompt, max_tokens=4, ignore_eos=True)
    run(sched)
    starts = [chunk.start for kind, body in ranks.commands if kind == "unified" for chunk in body[0]]
    assert starts == sorted(set(starts)) and starts[0] == 0 and len(starts) >= 2  # never sent twice
    assert second.tokens == alone.tokens and len(first.tokens) == 20
    assert_pools_full(ranks, sched)


def test_pipelined_cancellation_waits_for_the_step_in_flight() -> None:
    ranks, sched, request, sink = _pipelining(5)
    sched.cancel(request.request_id)
    run(sched)
    assert sink.finish.reason == "cancelled" and 3 <= len(sink.tokens) < 20
    assert ranks.commands[-1] == ("drop", (request.request_id, Expectation.MUST_EXIST, None))
    assert_pools_full(ranks, sched)


REASON = "prompt token id 99 is outside the vocabulary [0, 64) (position 0)"


@pipelined
def test_a_rejected_chunk_fails_its_request_alone_with_its_next_chunk_sent_or_not(pipeline: bool) -> None:
    _, sched = make()
    _, alone = submit(sched, [1], max_tokens=10, ignore_eos=True)
    run(sched)
    ranks, sched = make(pipeline=pipeline)
    _, going = submit(sched, [1], max_tokens=10, ignore_eos=True)
    for _ in range(3):
        sched.step()
    rejected, sink = submit(sched, list(range(2, 40)), max_tokens=4)  # three chunks of the budget
    ranks.rejects[rejected.request_id] = REASON
    run(sched)
    assert going.tokens == alone.tokens and going.finish.reason == "length"
    error = f"request {rejected.request_id} rejected by rank 0 during unified: {REASON}"
    assert sink.events == [ErrorEvent(error, rejected=True)]
    chunks = [c for kind, body in ranks.commands if kind == "unified" for c in body[0]]
    sent = [c.start for c in chunks if c.request_id == rejected.request_id]
    assert sent == ([0, 15] if pipeline else [0])  # pipelined, the next chunk was on its way
    assert ("drop", (rejected.request_id, Expectation.MUST_EXIST, None)) in ranks.commands
    assert_pools_full(ranks, sched)


@pipelined
def test_a_rejected_decode_row_fails_its_request_alone_and_frees_its_slot(pipeline: bool) -> None:
    _, sched = make()
    _, first_alone = submit(sched, [4, 5], max_tokens=10, ignore_eos=True)
    _, second_alone = submit(sched, [7], max_tokens=10, ignore_eos=True)
    run(sched)
    ranks, sched = make(pipeline=pipeline)
    first, first_sink = submit(sched, [4, 5], max_tokens=10, ignore_eos=True)
    _, second_sink = submit(sched, [7], max_tokens=10, ignore_eos=True)
    while len(first_sink.tokens) < 3:
        sched.step()
    ranks.rejects[first.request_id] = "logit_bias token id 70 is outside the vocabulary [0, 64)"
    run(sched)
    assert second_sink.tokens == second_alone.tokens and second_sink.finish.reason == "length"
    *tokens, error = first_sink.events
    assert first_sink.tokens == first_alone.tokens[: len(tokens)]
    assert error == ErrorEvent(
        f"request {first.request_id} rejected by rank 0 during decode: {ranks.rejects[first.request_id]}",
        True,
    )
    drop = next(body for kind, body in ranks.commands if kind == "drop" and body[0] == first.request_id)
    assert drop[1] is Expectation.MUST_EXIST and drop[2] is not None  # the other request moved down
    assert_pools_full(ranks, sched)
