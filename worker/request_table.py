"""Per-request state on one rank: its phase, how many tokens are cached, and where its state lives.

State slots ``0..max_slots-1`` are the dense decode slots (the scheduler assigns them).
Slots ``max_slots..2*max_slots-1`` are prefill staging states, which the worker hands out itself,
lowest free first: every rank sees the same commands in the same order, so every rank picks the
same staging slot without being told.

The dense decode slot map (``SlotTable``): ``owners[slot]`` is the request whose state lives in
that slot. The scheduler decides slots; the worker applies them and checks occupancy on every
change. A request gets its slot on its first decode row (admission). Retirement keeps slots dense:
the last slot moves into the hole, and the move names both sides so each can be checked.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from phalanx.worker.errors import WorkerStateError


class Phase(enum.Enum):
    PREFILLING = "prefilling"  # prompt chunks still arriving; state in a staging slot
    PREFILLED = "prefilled"  # prompt complete; waits for its first decode row
    DECODING = "decoding"  # state lives in its dense decode slot


@dataclass
class RequestState:
    request_id: int
    phase: Phase
    cached: int  # tokens in the KV cache, i.e. the position of the next token
    staging_slot: int | None
    decode_slot: int | None = None

    @property
    def state_slot(self) -> int:
        slot = self.decode_slot if self.phase is Phase.DECODING else self.staging_slot
        if slot is None:
            raise WorkerStateError(f"request {self.request_id} in phase {self.phase.value} has no state slot")
        return slot


class RequestTable:
    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self.requests: dict[int, RequestState] = {}
        self._free_staging = list(range(max_slots, 2 * max_slots))
        heapq.heapify(self._free_staging)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def get(self, request_id: int) -> RequestState | None:
        return self.requests.get(request_id)

    def require(self, request_id: int, op: str) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise WorkerStateError(f"{op} request {request_id} has no worker state")
        return state

    def begin(self, request_id: int, start: int = 0) -> RequestState:
        """A request's first prefill chunk: give it the lowest free staging slot. ``start`` is
        past 0 when the chunk restores a cached prefix of that many tokens."""
        if request_id in self.requests:
            raise WorkerStateError(
                f"request {request_id} already has worker state ({self.requests[request_id].phase.value}) "
                f"at a prefill chunk with start {start}"
            )
        if not self._free_staging:
            raise WorkerStateError(f"prefill chunks would exceed worker capacity {self.max_slots}")
        state = RequestState(request_id, Phase.PREFILLING, start, heapq.heappop(self._free_staging))
        self.requests[request_id] = state
        return state

    def promote(self, state: RequestState, decode_slot: int) -> None:
        """First decode row: the state has been copied into ``decode_slot``; free the staging slot."""
        self._free(state)
        state.phase = Phase.DECODING
        state.decode_slot = decode_slot

    def remove(self, request_id: int) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._free(state)
        return state

    def _free(self, state: RequestState) -> None:
        if state.staging_slot is not None:
            heapq.heappush(self._free_staging, state.staging_slot)
            state.staging_slot = None


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
