"""Dense decode slots: the requests in decode occupy slots ``0..n-1`` with no holes.

A request takes the next slot (``n``) when its first decode row is planned. Retiring the request
in slot ``i`` moves the request from the last slot into ``i``; the move travels to the workers
inside the retirement's ``DropRequest`` so their slot maps follow.
"""

from __future__ import annotations

from phalanx.protocol.messages import SlotMove


class DenseSlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owners: list[int] = []

    def __len__(self) -> int:
        return len(self._owners)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._owners

    @property
    def owners(self) -> list[int]:
        """Request ids in slot order (slot i holds owners[i])."""
        return list(self._owners)

    def slot_of(self, request_id: int) -> int:
        try:
            return self._owners.index(request_id)
        except ValueError:
            raise KeyError(f"request {request_id} holds no decode slot") from None

    def admit(self, request_id: int) -> int:
        if len(self._owners) >= self.capacity:
            raise RuntimeError(f"no free decode slot for request {request_id}: all {self.capacity} in use")
        if request_id in self._owners:
            raise RuntimeError(f"request {request_id} already holds decode slot {self.slot_of(request_id)}")
        self._owners.append(request_id)
        return len(self._owners) - 1

    def retire(self, request_id: int) -> SlotMove | None:
        """Free the request's slot; returns the compaction that fills the hole, if any."""
        hole = self.slot_of(request_id)
        last = len(self._owners) - 1
        moved = self._owners.pop()
        if hole == last:
            return None
        self._owners[hole] = moved
        return SlotMove(request_id=moved, from_slot=last, to_slot=hole)
