"""The prefix cache's state snapshots on one rank: what each snapshot slot holds, and the checks of
a prefill chunk's ``restore`` and ``save`` against it.

A snapshot slot keeps every Gated DeltaNet layer's conv and recurrent state of some prompt after
its first ``position`` tokens, under the coordinator's ``key`` for that prefix (``StateSnapshot``).
The coordinator picks the slots; the rank records every save and refuses a restore that names a
key or position other than the ones its slot holds, so a state is never resumed under another
prefix's name. The slots sit after the step slots in the model's state pool
(``worker/buckets.py``); ``state_slot`` maps a snapshot slot to its place there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from phalanx.protocol.messages import PrefillChunk, StateSnapshot
from phalanx.worker.errors import WorkerStateError


@dataclass(frozen=True)
class HeldSnapshot:
    key: int
    position: int


class SnapshotTable:
    def __init__(self, base: int = 0, count: int = 0) -> None:
        self.base = base  # the model state slot of snapshot slot 0
        self._held: list[HeldSnapshot | None] = [None] * count

    def __len__(self) -> int:
        return len(self._held)

    def state_slot(self, slot: int) -> int:
        return self.base + slot

    def held(self, slot: int) -> HeldSnapshot | None:
        return self._held[slot]

    def check_slot(self, request_id: int, verb: str, snapshot: StateSnapshot) -> None:
        if not 0 <= snapshot.slot < len(self._held):
            raise WorkerStateError(
                f"request {request_id} {verb} snapshot slot {snapshot.slot} outside the worker's "
                f"{len(self._held)} snapshot slots"
            )

    def check_restore(self, request_id: int, snapshot: StateSnapshot) -> None:
        """The slot must hold exactly the snapshot the restore names."""
        self.check_slot(request_id, "restores", snapshot)
        held = self._held[snapshot.slot]
        if held != HeldSnapshot(snapshot.key, snapshot.position):
            holds = "nothing" if held is None else f"key {held.key} at position {held.position}"
            raise WorkerStateError(
                f"request {request_id} restores snapshot slot {snapshot.slot} (key {snapshot.key} "
                f"at position {snapshot.position}) but the slot holds {holds}"
            )

    def record(self, snapshot: StateSnapshot) -> None:
        """A save has copied a state into the slot: it now holds that key and position."""
        self._held[snapshot.slot] = HeldSnapshot(snapshot.key, snapshot.position)


def check_restore(chunk: PrefillChunk, page_size: int, table: SnapshotTable) -> None:
    """A restore starts a new request at a page boundary past 0, from the snapshot its slot holds."""
    restore = chunk.restore
    if restore is None:
        return
    where = f"prefill chunk for request {chunk.request_id} restores a snapshot at position {restore.position}"
    if chunk.start != restore.position:
        raise WorkerStateError(f"{where} but starts at {chunk.start}")
    if restore.position == 0:
        raise WorkerStateError(f"{where}: a restored prefix holds at least one page")
    if restore.position % page_size:
        raise WorkerStateError(f"{where}, which is not a multiple of the page size {page_size}")
    table.check_restore(chunk.request_id, restore)


def check_saves(chunk: PrefillChunk, length: int, table: SnapshotTable) -> None:
    """Saves fall inside the chunk's positions ``(start, start + length]``, ascending, in range,
    and never on a chunk that asks for prompt logprobs (its positions are scored in one pass)."""
    if not chunk.save:
        return
    where = f"prefill chunk for request {chunk.request_id}"
    if chunk.prompt_logprobs is not None:
        raise WorkerStateError(f"{where} saves snapshots and asks for prompt logprobs")
    positions = [save.position for save in chunk.save]
    if any(later <= earlier for earlier, later in itertools.pairwise(positions)):
        raise WorkerStateError(f"{where} saves snapshots at positions {positions}, which do not ascend")
    end = chunk.start + length
    for save in chunk.save:
        if not chunk.start < save.position <= end:
            raise WorkerStateError(
                f"{where} saves a snapshot at position {save.position}, outside its positions "
                f"({chunk.start}, {end}]"
            )
        table.check_slot(chunk.request_id, "saves", save)


def check_distinct_save_slots(op: str, chunks: list[PrefillChunk]) -> None:
    """One command saves each snapshot slot once: two saves into one slot leave it ambiguous."""
    saver: dict[int, int] = {}
    for chunk in chunks:
        for save in chunk.save:
            if save.slot in saver:
                raise WorkerStateError(
                    f"one {op} command saves snapshot slot {save.slot} twice (requests "
                    f"{saver[save.slot]} and {chunk.request_id})"
                )
            saver[save.slot] = chunk.request_id
