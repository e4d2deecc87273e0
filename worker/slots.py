"""The dense decode slot map: ``owners[slot]`` is the request whose state lives in that slot.

The scheduler decides slots; the worker applies them and checks occupancy on every change.
A request gets its slot on its first decode row (admission). Retirement keeps slots dense: the
last slot moves into the hole, and the move names both sides so each can be checked.
"""

from __future__ import annotations

from phalanx.worker.errors import WorkerStateError


class SlotTable:
    def __init__(self, size: int) -> None:
        self.owners: list[int | None] = [None] * size

    def __len__(self) -> int:
        return len(self.owners)

    def _check_range(self, slot: int, request_id: int) -> None:
        if not 0 <= slot < len(self.owners):
            raise WorkerStateError(
                f"decode slot {slot} of request {request_id} exceeds worker slot map {len(self.owners)}"
            )

    def owner(self, slot: int) -> int | None:
        return self.owners[slot]

    def admit(self, slot: int, request_id: int) -> None:
        """Give ``slot`` to ``request_id`` on its first decode row; the slot must be free."""
        self._check_range(slot, request_id)
        owner = self.owners[slot]
        if owner is not None:
            raise WorkerStateError(
                f"decode slot {slot} still owned by request {owner} at admission of request {request_id}"
            )
        self.owners[slot] = request_id

    def release(self, slot: int, request_id: int) -> None:
        """Free the slot of a retiring request (no move: it was the last slot)."""
        self._check_range(slot, request_id)
        owner = self.owners[slot]
        if owner != request_id:
            raise WorkerStateError(
                f"slot {slot} holds request {owner} where the scheduler dropped request {request_id}"
            )
        self.owners[slot] = None

    def compact(self, dropped_id: int, moved_id: int, from_slot: int, to_slot: int) -> bool:
        """Move ``moved_id`` from ``from_slot`` into ``to_slot``, the slot ``dropped_id`` leaves.

        A slot that is occupied must hold the request the scheduler names; an empty slot is
        allowed (a request retired, or moved, before its first decode row never took its slot).
        Returns True when state must be copied (the moved request had materialised its slot).
        """
        self._check_range(to_slot, dropped_id)
        self._check_range(from_slot, moved_id)
        if from_slot == to_slot:
            raise WorkerStateError(f"slot compaction move {from_slot} -> {to_slot} is a no-op")
        to_owner = self.owners[to_slot]
        if to_owner is not None and to_owner != dropped_id:
            raise WorkerStateError(
                f"slot {to_slot} holds request {to_owner} where the scheduler dropped request {dropped_id}"
            )
        from_owner = self.owners[from_slot]
        if from_owner is not None and from_owner != moved_id:
            raise WorkerStateError(
                f"slot {from_slot} holds request {from_owner} where the scheduler moved request {moved_id}"
            )
        self.owners[to_slot] = from_owner
        self.owners[from_slot] = None
        return from_owner is not None
