"""Prefix-cache snapshots on one rank, with the real tiny model on the CPU (fp32).

A prompt prefilled with saves (mid-chunk, at a chunk's end, in waves beside other chunks), and
another resumed from a saved snapshot over the shared KV pages, must leave the same linear-attention
state, the same first-token logprobs and the same decode as an uninterrupted prefill of the same
prompt on a second copy of the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import DecodeRow, DropRequest, Expectation, StateSnapshot
from phalanx.worker.snapshots import HeldSnapshot
from tests.support.snapshot_runner import (
    DECODE_STEPS,
    SAMPLING,
    SNAPSHOTS,
    Outcome,
    assert_same,
    assert_states_equal,
    chunk,
    outcome,
    pages_for,
    prompt,
    snapshot_runner,
    states,
    uninterrupted,
)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Qwen35Model:
    """A second copy of the model for the uninterrupted prefills (each test's runner owns the
    first one's cache)."""
    return Qwen35Model.load(tiny_model_dir)


def test_a_save_mid_chunk_and_a_restore_match_uninterrupted_prefills(
    model: Qwen35Model, reference: Qwen35Model
) -> None:
    shared = prompt(1, 21)
    other = shared[:16] + prompt(2, 7)
    want_shared, want_other = uninterrupted(reference, shared), uninterrupted(reference, other)
    want_at = {n: uninterrupted(reference, shared[:n]).state for n in (8, 16)}
    runner = snapshot_runner(model)
    shared_pages = pages_for(0, len(shared) + DECODE_STEPS)
    saves = (StateSnapshot(0, 11, 8), StateSnapshot(1, -22, 16))
    (first,) = runner.prefill([chunk(1, shared, 0, shared_pages, save=saves)]).results
    assert [runner.snapshots.held(slot) for slot in range(SNAPSHOTS)] == [
        HeldSnapshot(11, 8),
        HeldSnapshot(-22, 16),
        None,
        None,
    ]
    for slot, position in ((0, 8), (1, 16)):
        assert_states_equal(states(model, runner.snapshots.state_slot(slot)), want_at[position])
    assert_same(outcome(runner, 1, first, 0, len(shared), shared_pages), want_shared)
    # The other prompt resumes after the shared 16 tokens: their 4 KV pages, the snapshot at 16.
    other_pages = shared_pages[:4] + pages_for(10, len(other) + DECODE_STEPS - 16)
    tail = chunk(2, other[16:], 16, other_pages, restore=StateSnapshot(1, -22, 16))
    (first,) = runner.prefill([tail]).results
    assert runner.requests.requests[2].cached == len(other)
    assert_same(outcome(runner, 2, first, 1, len(other), other_pages), want_other)


def test_one_command_restores_a_slot_before_another_request_saves_over_it(
    model: Qwen35Model, reference: Qwen35Model
) -> None:
    """Request 3 resumes from slot 0 while request 4, in the same Unified beside request 1's
    first decode row, saves into slot 0 at a chunk's end and into slot 2 mid-chunk."""
    shared, fresh = prompt(3, 21), prompt(4, 12)
    resumed = shared[:8] + prompt(5, 9)
    wants = [uninterrupted(reference, tokens) for tokens in (shared, resumed, fresh)]
    want_at_4 = uninterrupted(reference, fresh[:4]).state
    runner = snapshot_runner(model)
    shared_pages = pages_for(0, len(shared) + DECODE_STEPS)
    runner.prefill([chunk(1, shared[:12], 0, shared_pages, last=False, save=(StateSnapshot(0, 7, 8),))])
    (first,) = runner.prefill([chunk(1, shared[12:], 12, shared_pages)]).results
    resumed_pages = shared_pages[:2] + pages_for(10, len(resumed) + DECODE_STEPS - 8)
    fresh_pages = pages_for(20, len(fresh) + DECODE_STEPS)
    reply = runner.unified(
        [
            chunk(3, resumed[8:], 8, resumed_pages, restore=StateSnapshot(0, 7, 8)),
            chunk(4, fresh, 0, fresh_pages, save=(StateSnapshot(2, 8, 4), StateSnapshot(0, 9, 12))),
        ],
        [DecodeRow(1, 0, first.token, len(shared), pack_ids(shared_pages), SAMPLING)],
    ).reply()
    assert [runner.snapshots.held(slot) for slot in (0, 2)] == [HeldSnapshot(9, 12), HeldSnapshot(8, 4)]
    assert_states_equal(states(model, runner.snapshots.state_slot(2)), want_at_4)
    resumed_first, fresh_first = reply.prefill
    assert_same(outcome(runner, 3, resumed_first, 1, len(resumed), resumed_pages), wants[1])
    assert_same(outcome(runner, 4, fresh_first, 2, len(fresh), fresh_pages), wants[2])
    assert_states_equal(states(model, runner.snapshots.state_slot(0)), wants[2].state)
    assert [r.token for r in (first, *reply.decode)] == [r.token for r in wants[0].results[:2]]


def test_prompt_logprobs_beside_a_chunk_that_saves_score_the_same(model: Qwen35Model) -> None:
    scored, saving = prompt(6, 9), prompt(7, 13)
    alone = snapshot_runner(model).prefill([chunk(5, scored, 0, pages_for(0, 9), prompt_logprobs=3)])
    runner = snapshot_runner(model)
    beside = runner.prefill(
        [
            chunk(6, saving, 0, pages_for(10, 13), save=(StateSnapshot(3, 1, 4), StateSnapshot(1, 2, 8))),
            chunk(5, scored, 0, pages_for(0, 9), prompt_logprobs=3),
        ]
    )
    (want,), (got,) = alone.prompt_logprobs, beside.prompt_logprobs
    assert (got.request_id, got.start, got.ranks, got.top_ids) == (5, 1, want.ranks, want.top_ids)
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert beside.results[1].token == alone.results[0].token


def test_graph_decode_and_a_dropped_resumed_request_leave_the_snapshot_alone(
    model: Qwen35Model, reference: Qwen35Model
) -> None:
    """In graph mode three rows pad to the bucket of 4 through the spare slot right below the
    snapshot slots; a request dropped right after its restore (a cancel) leaves the snapshot for
    the next request that resumes from it."""
    shared, other = prompt(8, 14), prompt(9, 10)
    resumed = shared[:8] + prompt(10, 5)
    want = uninterrupted(reference, resumed)
    want_at_8 = uninterrupted(reference, shared[:8]).state
    runner = snapshot_runner(model, graphs=True)
    pages = {1: pages_for(0, 20), 2: pages_for(5, 20), 4: pages_for(0, 8) + pages_for(10, 12)}
    firsts = runner.prefill(
        [chunk(1, shared, 0, pages[1], save=(StateSnapshot(0, 3, 8),)), chunk(2, other, 0, pages[2])]
    ).results
    resume = StateSnapshot(0, 3, 8)
    runner.prefill([chunk(3, resumed[8:], 8, pages[4], restore=resume)])
    assert runner.drop(DropRequest(3, Expectation.MUST_EXIST)) is True
    (first,) = runner.prefill([chunk(4, resumed[8:], 8, pages[4], restore=resume)]).results
    assert_states_equal(states(model, runner.requests.requests[4].state_slot), want.state)
    results = {1: [firsts[0]], 2: [firsts[1]], 4: [first]}
    lengths = {1: len(shared), 2: len(other), 4: len(resumed)}
    for step in range(DECODE_STEPS):
        rows = [
            DecodeRow(r, slot, results[r][-1].token, lengths[r] + step, pack_ids(pages[r]), SAMPLING)
            for slot, r in enumerate((1, 2, 4))
        ]
        for result in runner.decode(rows).results():
            results[result.request_id].append(result)
    assert_same(Outcome(results[4], want.state), want)
    assert runner.snapshots.held(0) == HeldSnapshot(3, 8)
    assert_states_equal(states(model, runner.snapshots.state_slot(0)), want_at_8)


def test_saves_on_the_delta_rules_grid_are_taken_in_the_same_pass(
    model: Qwen35Model, reference: Qwen35Model
) -> None:
    """Request 1 saves at 64 and 164 (on the 64-token grid of their segments: captured in the
    pass), at 100 (off it: the chunk is cut there) and at 200, its end; request 2, the batch's
    second chunk, captures at 64. Every snapshot equals an uninterrupted prefill that stops there,
    and the one at 164 resumes a prompt that shares those tokens."""
    long, other = prompt(11, 200), prompt(12, 70)
    want_at = {n: uninterrupted(reference, long[:n]).state for n in (64, 100, 164, 200)}
    want_other_at_64 = uninterrupted(reference, other[:64]).state
    resumed = long[:164] + prompt(13, 9)
    want_resumed = uninterrupted(reference, resumed)
    runner = snapshot_runner(model, snapshots=6)
    saves = tuple(StateSnapshot(slot, 10 + slot, n) for slot, n in enumerate((64, 100, 164, 200)))
    long_pages, other_pages = pages_for(0, 200), pages_for(60, 70)
    runner.prefill(
        [
            chunk(1, long, 0, long_pages, save=saves),
            chunk(2, other, 0, other_pages, save=(StateSnapshot(4, 14, 64),)),
        ]
    )
    for slot, n in enumerate((64, 100, 164, 200)):
        assert runner.snapshots.held(slot) == HeldSnapshot(10 + slot, n)
        assert_states_equal(states(model, runner.snapshots.state_slot(slot)), want_at[n])
    assert_states_equal(states(model, runner.snapshots.state_slot(4)), want_other_at_64)
    resumed_pages = long_pages[:41] + pages_for(100, len(resumed) + DECODE_STEPS - 164)
    (first,) = runner.prefill(
        [chunk(3, resumed[164:], 164, resumed_pages, restore=StateSnapshot(2, 12, 164))]
    ).results
    assert_same(outcome(runner, 3, first, 0, len(resumed), resumed_pages), want_resumed)
