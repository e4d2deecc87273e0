"""A rank refuses every restore and save that disagrees with its snapshot slots or with the chunk
(``worker/snapshots.py``), in words that name the request, the slot and the positions, before any
model work; and a chunk with save points is cut into the waves ``worker/prefill_waves.py`` runs."""

from __future__ import annotations

import pytest

from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.messages import PrefillChunk, StateSnapshot
from phalanx.worker.commands import StepRunner
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.prefill_waves import Segment, split_waves
from phalanx.worker.request_table import Phase, RequestState
from phalanx.worker.snapshots import HeldSnapshot
from phalanx.worker.step_plans import ChunkPlan
from tests.support.snapshot_runner import PAGE, chunk, snapshot_runner

PAGES = list(range(8))


@pytest.fixture
def saved(model: Qwen35Model) -> StepRunner:
    """Slot 1 holds key 5 at position 8 (request 1's first 8 of 12 tokens); the others nothing."""
    runner = snapshot_runner(model)
    runner.prefill([chunk(1, list(range(3, 15)), 0, PAGES, save=(StateSnapshot(1, 5, 8),))])
    return runner


def refused(runner: StepRunner, chunks: list[PrefillChunk], text: str) -> None:
    with pytest.raises(WorkerStateError) as caught:
        runner.prefill(chunks)
    assert str(caught.value) == text
    assert runner.snapshots.held(1) == HeldSnapshot(5, 8)  # a refused command saved nothing


def test_a_restore_names_exactly_what_its_slot_holds(saved: StepRunner) -> None:
    tail = [20, 21, 22]
    cases = [
        (
            StateSnapshot(1, 6, 8),
            "request 2 restores snapshot slot 1 (key 6 at position 8) but the slot holds key 5 at position 8",
        ),
        (
            StateSnapshot(0, 5, 8),
            "request 2 restores snapshot slot 0 (key 5 at position 8) but the slot holds nothing",
        ),
        (StateSnapshot(4, 5, 8), "request 2 restores snapshot slot 4 outside the worker's 4 snapshot slots"),
    ]
    for snapshot, text in cases:
        refused(saved, [chunk(2, tail, 8, PAGES, restore=snapshot)], text)
        saved.requests.remove(2)


def test_a_restore_starts_a_new_request_at_its_page_boundary(saved: StepRunner) -> None:
    where = "prefill chunk for request 2 restores a snapshot at position"
    cases = [
        (chunk(2, [20], 4, PAGES, restore=StateSnapshot(1, 5, 8)), f"{where} 8 but starts at 4"),
        (
            chunk(2, [20], 0, PAGES, restore=StateSnapshot(1, 5, 0)),
            f"{where} 0: a restored prefix holds at least one page",
        ),
        (
            chunk(2, [20], 6, PAGES, restore=StateSnapshot(1, 5, 6)),
            f"{where} 6, which is not a multiple of the page size {PAGE}",
        ),
        (
            chunk(1, [20], 8, PAGES, restore=StateSnapshot(1, 5, 8)),
            "request 1 already has worker state (prefilled) at a prefill chunk with start 8",
        ),
    ]
    for refused_chunk, text in cases:
        refused(saved, [refused_chunk], text)
    assert 2 not in saved.requests


def test_saves_fall_inside_the_chunk_in_order_in_range_and_once(saved: StepRunner) -> None:
    where = "prefill chunk for request 2"
    tokens = list(range(30, 38))  # positions 0..7 of a new request: saves in (0, 8]
    cases = [
        ((StateSnapshot(0, 1, 0),), f"{where} saves a snapshot at position 0, outside its positions (0, 8]"),
        ((StateSnapshot(0, 1, 9),), f"{where} saves a snapshot at position 9, outside its positions (0, 8]"),
        (
            (StateSnapshot(0, 1, 4), StateSnapshot(2, 1, 4)),
            f"{where} saves snapshots at positions [4, 4], which do not ascend",
        ),
        ((StateSnapshot(7, 1, 4),), "request 2 saves snapshot slot 7 outside the worker's 4 snapshot slots"),
    ]
    for saves, text in cases:
        refused(saved, [chunk(2, tokens, 0, PAGES, save=saves)], text)
        saved.requests.remove(2)
    refused(
        saved,
        [chunk(2, tokens, 0, PAGES, save=(StateSnapshot(0, 1, 8),), prompt_logprobs=0)],
        f"{where} saves snapshots and asks for prompt logprobs",
    )
    saved.requests.remove(2)
    refused(
        saved,
        [
            chunk(2, tokens, 0, PAGES, save=(StateSnapshot(2, 1, 4),)),
            chunk(3, tokens, 0, PAGES, save=(StateSnapshot(2, 1, 8),)),
        ],
        "one prefill command saves snapshot slot 2 twice (requests 2 and 3)",
    )


def test_a_rank_without_snapshot_slots_refuses_every_save(runner: StepRunner) -> None:
    with pytest.raises(WorkerStateError) as caught:
        runner.prefill([chunk(1, [4, 5, 6, 7], 0, [0], save=(StateSnapshot(0, 1, 4),))])
    assert str(caught.value) == "request 1 saves snapshot slot 0 outside the worker's 0 snapshot slots"


def _plan(request_id: int, start: int, length: int, saves: list[int]) -> ChunkPlan:
    snapshot = [StateSnapshot(i, request_id, p) for i, p in enumerate(saves)]
    chunk = PrefillChunk(request_id, b"", start, b"", True, save=snapshot)
    return ChunkPlan(chunk, RequestState(request_id, Phase.PREFILLING, start, 3), [1] * length, [])


def test_waves_cut_each_chunk_at_its_save_points() -> None:
    plan = _plan
    # Request 1 saves at 12 (mid-chunk) and at 16, its end; request 2 saves nothing; request 3 at 4.
    waves = split_waves([plan(1, 8, 8, [12, 16]), plan(2, 0, 5, []), plan(3, 0, 6, [4])])
    save = StateSnapshot
    assert waves == [
        [
            Segment(0, 0, 4, save(0, 1, 12), final=False),
            Segment(1, 0, 5, None, final=True),
            Segment(2, 0, 4, save(0, 3, 4), final=False),
        ],
        [Segment(0, 4, 8, save(1, 1, 16), final=True), Segment(2, 4, 6, None, final=True)],
    ]


def test_saves_on_the_64_token_grid_are_captured_in_one_wave() -> None:
    """Saves at multiples of 64 past the chunk's start are taken inside its pass and one at its end
    is a copy after it; any other save cuts the chunk, and the grid then counts from the cut:
    request 2 is cut at 100 only, and takes 164 inside its second pass."""
    save = StateSnapshot
    waves = split_waves(
        [_plan(1, 64, 200, [128, 192, 264]), _plan(2, 0, 200, [64, 100, 164, 200]), _plan(3, 64, 100, [128])]
    )
    assert waves == [
        [
            Segment(0, 0, 200, save(2, 1, 264), final=True, captures=(save(0, 1, 128), save(1, 1, 192))),
            Segment(1, 0, 100, save(1, 2, 100), final=False, captures=(save(0, 2, 64),)),
            Segment(2, 0, 100, None, final=True, captures=(save(0, 3, 128),)),
        ],
        [Segment(1, 100, 200, save(3, 2, 200), final=True, captures=(save(2, 2, 164),))],
    ]
