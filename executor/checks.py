"""Structural checks before dispatch. A failure raises StepRejected and poisons nothing: the
coordinator can prove the command wrong without asking any rank."""

from __future__ import annotations

import itertools

from phalanx.executor.errors import StepRejected
from phalanx.protocol.codec import unpack_ids
from phalanx.protocol.messages import (
    FED_TOKEN,
    MAX_LOGPROBS,
    NO_FEED,
    NO_TOKEN,
    Capacity,
    Command,
    Decode,
    DecodeRow,
    DropRequest,
    Prefill,
    PrefillChunk,
    Unified,
)


def _pages(op: str, request_id: int, packed: bytes, covered: int, capacity: Capacity) -> None:
    if len(packed) % 4:
        raise StepRejected(f"{op} page table of request {request_id} is not packed int32")
    pages = unpack_ids(packed)
    needed = -(-covered // capacity.page_size)
    if len(pages) < needed:
        raise StepRejected(
            f"{op} page table of request {request_id} has {len(pages)} pages; {needed} are needed for {covered} tokens"
        )
    if len(pages) and (int(pages.min()) < 0 or int(pages.max()) > capacity.kv_pages):
        raise StepRejected(
            f"{op} page table of request {request_id} has page ids outside 0..{capacity.kv_pages}"
        )


def _request_id(op: str, request_id: int) -> None:
    if request_id <= 0:
        raise StepRejected(f"{op} request id {request_id} is invalid (ids start at 1)")


def _unique(op: str, request_ids: list[int]) -> None:
    seen: set[int] = set()
    for request_id in request_ids:
        if request_id in seen:
            raise StepRejected(f"duplicate request id {request_id} in one {op} command")
        seen.add(request_id)


def check_prefill(
    chunks: list[PrefillChunk], capacity: Capacity, vocab_size: int, op: str = "prefill"
) -> None:
    if not chunks:
        raise StepRejected(f"{op} has no chunks")
    _unique(op, [chunk.request_id for chunk in chunks])
    total = 0
    fed: set[int] = set()
    saved: set[int] = set()
    for chunk in chunks:
        _request_id(op, chunk.request_id)
        if len(chunk.tokens) % 4:
            raise StepRejected(f"{op} tokens of request {chunk.request_id} are not packed int32")
        tokens = unpack_ids(chunk.tokens)
        if not len(tokens):
            raise StepRejected(f"{op} chunk for request {chunk.request_id} is empty")
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
            raise StepRejected(
                f"{op} chunk for request {chunk.request_id} has token ids outside 0..{vocab_size - 1}"
            )
        if chunk.start < 0:
            raise StepRejected(
                f"{op} chunk for request {chunk.request_id} starts at negative position {chunk.start}"
            )
        total += len(tokens)
        _pages(op, chunk.request_id, chunk.page_ids, chunk.start + len(tokens), capacity)
        _feed_slot(op, chunk, capacity, fed)
        _prompt_logprobs(op, chunk, vocab_size)
        _snapshots(op, chunk, len(tokens), capacity, saved)
    if total > capacity.max_batch_tokens:
        raise StepRejected(f"{op} has {total} tokens, exceeding max_batch_tokens {capacity.max_batch_tokens}")


def _feed_slot(op: str, chunk: PrefillChunk, capacity: Capacity, fed: set[int]) -> None:
    slot = chunk.feed_slot
    if slot == NO_FEED:
        return
    where = f"{op} chunk for request {chunk.request_id} feeds slot {slot}"
    if op != "prefill":
        raise StepRejected(f"{where}: only a prefill may feed a decode slot")
    if not chunk.last:
        raise StepRejected(f"{where} but is not its prompt's last chunk")
    if not 0 <= slot < capacity.max_slots:
        raise StepRejected(f"{where} outside 0..{capacity.max_slots - 1}")
    if slot in fed:
        raise StepRejected(f"{op} has two chunks feeding slot {slot}")
    fed.add(slot)


def _prompt_logprobs(op: str, chunk: PrefillChunk, vocab_size: int) -> None:
    where = f"{op} chunk for request {chunk.request_id}"
    if chunk.prompt_logprobs is not None and not 0 <= chunk.prompt_logprobs <= MAX_LOGPROBS:
        raise StepRejected(
            f"{where} asks for {chunk.prompt_logprobs} prompt top logprobs (0..{MAX_LOGPROBS})"
        )
    if chunk.prompt_logprobs is not None and chunk.last != (chunk.next_token == NO_TOKEN):
        raise StepRejected(f"{where} has next_token {chunk.next_token} but last={chunk.last}")
    if chunk.next_token != NO_TOKEN and not 0 <= chunk.next_token < vocab_size:
        raise StepRejected(f"{where} has next_token {chunk.next_token} outside 0..{vocab_size - 1}")
    if chunk.grammar is not None and not chunk.last:
        raise StepRejected(f"{where} carries a grammar but is not its prompt's last chunk")


def _snapshots(op: str, chunk: PrefillChunk, length: int, capacity: Capacity, saved: set[int]) -> None:
    """Snapshot slots the ranks keep, a restore at the chunk's start on a page boundary past 0,
    saves inside the chunk in order and each slot saved once (what the slots hold, the ranks check)."""
    where = f"{op} chunk for request {chunk.request_id}"
    restore = [chunk.restore] if chunk.restore is not None else []
    for snapshot in restore + chunk.save:
        if snapshot.slot >= capacity.snapshot_slots:
            raise StepRejected(
                f"{where} names snapshot slot {snapshot.slot}; the ranks keep {capacity.snapshot_slots}"
            )
    if chunk.restore is not None and not (
        chunk.restore.position == chunk.start > 0 and chunk.start % capacity.page_size == 0
    ):
        raise StepRejected(
            f"{where} starts at {chunk.start} but restores a snapshot at position {chunk.restore.position} "
            f"(a page boundary past 0)"
        )
    positions = [save.position for save in chunk.save]
    bounds = [chunk.start, *positions]
    if positions and (
        any(later <= earlier for earlier, later in itertools.pairwise(bounds))
        or positions[-1] > chunk.start + length
    ):
        raise StepRejected(
            f"{where} saves snapshots at positions {positions}, not ascending inside "
            f"({chunk.start}, {chunk.start + length}]"
        )
    if positions and chunk.prompt_logprobs is not None:
        raise StepRejected(f"{where} saves snapshots and asks for prompt logprobs")
    for save in chunk.save:
        if save.slot in saved:
            raise StepRejected(f"{op} saves snapshot slot {save.slot} twice")
        saved.add(save.slot)


def check_decode(rows: list[DecodeRow], capacity: Capacity, vocab_size: int, op: str = "decode") -> None:
    if not rows:
        raise StepRejected(f"{op} has no rows")
    if len(rows) > capacity.max_slots:
        raise StepRejected(f"{op} has {len(rows)} rows, exceeding max_slots {capacity.max_slots}")
    _unique(op, [row.request_id for row in rows])
    slots: set[int] = set()
    for row in rows:
        _request_id(op, row.request_id)
        if not 0 <= row.slot < capacity.max_slots:
            raise StepRejected(
                f"{op} row of request {row.request_id} has slot {row.slot} outside 0..{capacity.max_slots - 1}"
            )
        if row.slot in slots:
            raise StepRejected(f"{op} has two rows in slot {row.slot}")
        slots.add(row.slot)
        if not (0 <= row.token < vocab_size or row.token == FED_TOKEN):
            raise StepRejected(
                f"{op} row of request {row.request_id} has token {row.token} outside 0..{vocab_size - 1} "
                f"(or FED_TOKEN {FED_TOKEN})"
            )
        if row.position < 0:
            raise StepRejected(f"{op} row of request {row.request_id} has negative position {row.position}")
        _pages(op, row.request_id, row.page_ids, row.position + 1, capacity)


def check_unified(
    chunks: list[PrefillChunk], rows: list[DecodeRow], capacity: Capacity, vocab_size: int
) -> None:
    if not chunks or not rows:
        raise StepRejected("unified needs both prefill chunks and decode rows")
    check_prefill(chunks, capacity, vocab_size, "unified")
    check_decode(rows, capacity, vocab_size, "unified")
    both = {chunk.request_id for chunk in chunks} & {row.request_id for row in rows}
    if both:
        raise StepRejected(f"unified request {min(both)} appears in both prefill and decode")


def check_drop(command: DropRequest, capacity: Capacity) -> None:
    _request_id("drop request", command.request_id)
    move = command.move
    if move is None:
        return
    _request_id("drop request move", move.request_id)
    if move.request_id == command.request_id:
        raise StepRejected(f"drop request {command.request_id} moves the dropped request itself")
    if move.from_slot == move.to_slot:
        raise StepRejected(f"drop request slot move {move.from_slot} -> {move.to_slot} is a no-op")
    for slot in (move.from_slot, move.to_slot):
        if not 0 <= slot < capacity.max_slots:
            raise StepRejected(f"drop request slot move uses slot {slot} outside 0..{capacity.max_slots - 1}")


def check_command(command: Command, capacity: Capacity, vocab_size: int) -> None:
    """The structural check of ``command`` by its type (Ping, Precapture and Shutdown carry nothing)."""
    match command:
        case Prefill(chunks=chunks):
            check_prefill(chunks, capacity, vocab_size)
        case Decode(rows=rows):
            check_decode(rows, capacity, vocab_size)
        case Unified(prefill=chunks, decode=rows):
            check_unified(chunks, rows, capacity, vocab_size)
        case DropRequest():
            check_drop(command, capacity)
