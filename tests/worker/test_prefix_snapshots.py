"""Prefix-cache snapshots on one rank, with the real tiny model on the CPU (fp32).

A prompt prefilled with saves (mid-chunk, at a chunk's end, in waves beside other chunks), and
another resumed from a saved snapshot over the shared KV pages, must leave the same linear-attention
state, the same first-token logprobs and the same decode as an uninterrupted prefill of the same
prompt on a second copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.messages import (
    MAX_LOGPROBS,
    DecodeRow,
    PrefillChunk,
    SamplingParams,
    StateSnapshot,
    TokenResult,
)
from phalanx.protocol.packing import pack_ids
from phalanx.worker.buckets import state_slot_layout
from phalanx.worker.commands import StepRunner
from phalanx.worker.snapshots import HeldSnapshot, SnapshotTable

PAGE = 4
MAX_SLOTS = 3
KV_PAGES = 40
SNAPSHOTS = 4
DECODE_STEPS = 3
SAMPLING = SamplingParams(logprobs=MAX_LOGPROBS)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Qwen35Model:
    """A second copy of the model for the uninterrupted prefills (each test's runner owns the
    first one's cache)."""
    return Qwen35Model.load(tiny_model_dir)


def snapshot_runner(model: Qwen35Model, snapshots: int = SNAPSHOTS) -> StepRunner:
    layout = state_slot_layout(MAX_SLOTS, cuda_graph=False, snapshot_slots=snapshots)
    model.allocate_cache(KV_PAGES + 1, PAGE, layout.total)
    table = SnapshotTable(layout.snapshot_base, snapshots)
    return StepRunner(model, CPU, 0, PAGE, KV_PAGES, MAX_SLOTS, 64, table)


def chunk(
    request_id: int,
    tokens: list[int],
    start: int,
    pages: list[int],
    last: bool = True,
    restore: StateSnapshot | None = None,
    save: tuple[StateSnapshot, ...] = (),
    prompt_logprobs: int | None = None,
) -> PrefillChunk:
    return PrefillChunk(
        request_id,
        pack_ids(tokens),
        start,
        pack_ids(pages),
        last,
        SAMPLING,
        prompt_logprobs=prompt_logprobs,
        restore=restore,
        save=list(save),
    )


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def pages_for(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // PAGE)))


def states(model: Qwen35Model, slot: int) -> list[torch.Tensor]:
    """Every linear-attention layer's recurrent and conv state in ``slot``."""
    out = []
    for gdn in (layer.linear_attention for layer in model.layers if layer.linear_attention):
        out += [gdn.recurrent_state[slot].clone(), gdn.conv_state[slot].clone()]
    return out


@dataclass
class Outcome:
    results: list[TokenResult]  # the prompt's first token, then DECODE_STEPS greedy decodes
    state: list[torch.Tensor]  # right after the prompt's prefill


def decode_on(
    runner: StepRunner, request_id: int, slot: int, first: TokenResult, position: int, pages: list[int]
) -> list[TokenResult]:
    results = [first]
    for step in range(DECODE_STEPS):
        row = DecodeRow(request_id, slot, results[-1].token, position + step, pack_ids(pages), SAMPLING)
        results += runner.decode([row]).results()
    return results


def uninterrupted(reference: Qwen35Model, tokens: list[int]) -> Outcome:
    runner = snapshot_runner(reference)
    pages = pages_for(0, len(tokens) + DECODE_STEPS)
    (first,) = runner.prefill([chunk(1, tokens, 0, pages)]).results
    state = states(reference, runner.requests.requests[1].state_slot)
    return Outcome(decode_on(runner, 1, 0, first, len(tokens), pages), state)


def outcome(
    runner: StepRunner, request_id: int, first: TokenResult, slot: int, length: int, pages: list[int]
) -> Outcome:
    state = states(runner.model, runner.requests.requests[request_id].state_slot)
    return Outcome(decode_on(runner, request_id, slot, first, length, pages), state)


def assert_states_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for got_part, want_part in zip(got, want, strict=True):
        torch.testing.assert_close(got_part, want_part, rtol=1e-4, atol=1e-5)


def assert_same(got: Outcome, want: Outcome) -> None:
    assert_states_equal(got.state, want.state)
    assert [r.token for r in got.results] == [r.token for r in want.results]
    for got_result, want_result in zip(got.results, want.results, strict=True):
        assert got_result.top_ids == want_result.top_ids
        assert got_result.top_logprobs == pytest.approx(want_result.top_logprobs, abs=1e-4)


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
