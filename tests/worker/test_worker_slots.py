"""The worker's slot map and request table: occupancy checks with the contract's error texts."""

from __future__ import annotations

import pytest

from phalanx.worker.errors import WorkerStateError
from phalanx.worker.request_table import Phase, RequestTable, SlotTable


def test_admit_checks_range_and_occupancy() -> None:
    slots = SlotTable(2)
    slots.admit(0, 10)
    with pytest.raises(
        WorkerStateError, match="^decode slot 0 still owned by request 10 at admission of request 11$"
    ):
        slots.admit(0, 11)
    with pytest.raises(WorkerStateError, match="^decode slot 2 of request 11 exceeds worker slot map 2$"):
        slots.admit(2, 11)


def test_compact_moves_the_last_slot_into_the_hole() -> None:
    slots = SlotTable(3)
    for slot, request in enumerate((10, 11, 12)):
        slots.admit(slot, request)
    assert slots.compact(dropped_id=10, moved_id=12, from_slot=2, to_slot=0) is True
    assert slots.owners == [12, 11, None]
    slots.release(1, 11)
    assert slots.owners == [12, None, None]


def test_compact_checks_both_sides() -> None:
    slots = SlotTable(3)
    for slot, request in enumerate((10, 11, 12)):
        slots.admit(slot, request)
    with pytest.raises(
        WorkerStateError, match="^slot 1 holds request 11 where the scheduler dropped request 10$"
    ):
        slots.compact(dropped_id=10, moved_id=12, from_slot=2, to_slot=1)
    with pytest.raises(
        WorkerStateError, match="^slot 1 holds request 11 where the scheduler moved request 12$"
    ):
        slots.compact(dropped_id=10, moved_id=12, from_slot=1, to_slot=0)
    with pytest.raises(WorkerStateError, match="no-op"):
        slots.compact(dropped_id=10, moved_id=12, from_slot=0, to_slot=0)


def test_compact_tolerates_requests_that_never_took_their_slot() -> None:
    slots = SlotTable(2)
    # Neither request reached its first decode row: nothing to copy, nothing to check against.
    assert slots.compact(dropped_id=10, moved_id=11, from_slot=1, to_slot=0) is False
    assert slots.owners == [None, None]


def test_release_checks_the_owner() -> None:
    slots = SlotTable(2)
    slots.admit(1, 5)
    with pytest.raises(
        WorkerStateError, match="^slot 1 holds request 5 where the scheduler dropped request 6$"
    ):
        slots.release(1, 6)


def test_staging_slots_are_handed_out_lowest_first_and_bounded() -> None:
    table = RequestTable(max_slots=2)
    first, second = table.begin(1), table.begin(2)
    assert (first.staging_slot, second.staging_slot) == (2, 3)
    with pytest.raises(WorkerStateError, match="^prefill chunks would exceed worker capacity 2$"):
        table.begin(3)
    table.remove(1)
    assert table.begin(3).staging_slot == 2
    table.promote(second, decode_slot=0)
    assert second.phase is Phase.DECODING and second.state_slot == 0
    assert table.begin(4).staging_slot == 3
    with pytest.raises(WorkerStateError, match="already has worker state"):
        table.begin(4)
    with pytest.raises(WorkerStateError, match="^decode request 9 has no worker state$"):
        table.require(9, "decode")
