"""A test double that stands in for the ranks behind the executor, for scheduler unit tests.

It keeps the state a worker keeps (prefill staging, the dense slot map, page ownership) and
checks every command the way a worker does, raising ``RankStateError`` on any mismatch. Its
"model" samples a token from a hash of the request's own fed tokens (and seed), so a request's
output depends only on what the scheduler fed it: if the scheduler misplaces a token, a position
or a page, the output changes or a check fires.

Prefix caching: a snapshot slot keeps (key, position, the tokens fed so far); a restore must name
what the slot holds, and every KV page below the restored position must hold the snapshot's
tokens. A page may be in several requests' tables, but no request writes a page another live
request holds. Restores of a command run before its saves.

Every command (``send``) is carried out at once and its reply held until ``collect``, which must
read the steps in the order they were sent. A ``FED_TOKEN`` row must follow a decode of its
request in the same slot, or a prefill whose last chunk named that slot (``feed_slot``), and the
fake refuses a prefill or a drop while a step is uncollected: the scheduler reads every step in
flight before it prefills alone or drops. Each reply passes the executor's own check against its
command (executor.replies), as a real executor's does before the scheduler sees it. The requests
named in ``rejects`` are rejected by "rank 0" in every command that carries them, as a rank
rejects a request with a value it cannot serve: their chunks and rows still run, their tokens are
held back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from phalanx.executor.replies import validate
from phalanx.protocol import PROTOCOL_VERSION
from phalanx.protocol.codec import unpack_list
from phalanx.protocol.messages import (
    FED_TOKEN,
    NO_FEED,
    Ack,
    Capacity,
    Command,
    Decode,
    DecodeDone,
    DecodeRow,
    DropAck,
    DropRequest,
    Expectation,
    Ping,
    Prefill,
    PrefillChunk,
    PrefillDone,
    ReplyEnvelope,
    RequestRejected,
    SamplingParams,
    StateSnapshot,
    TokenResult,
    Unified,
    UnifiedDone,
)

Reply = Ack | DropAck | PrefillDone | DecodeDone | UnifiedDone


class RankStateError(RuntimeError):
    pass


@dataclass
class _State:
    fed: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    prompt_done: bool = False
    last_sampled: int | None = None


def fake_token(fed: list[int], sampling: SamplingParams, vocab: int) -> int:
    digest = hashlib.blake2b(repr((fed, sampling.seed, sampling.temperature > 0)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") % vocab


class FakeRanks:
    rejected_frames = 0  # no socket: nothing to reject

    def __init__(self, capacity: Capacity, vocab: int = 64) -> None:
        self.capacity = capacity
        self.vocab = vocab
        self.staging: dict[int, _State] = {}
        self.slot_map: list[int | None] = [None] * capacity.max_slots
        self.slot_state: dict[int, _State] = {}
        self.commands: list[tuple[str, object]] = []
        self.fail_on_drop_of: int | None = None
        self.rejects: dict[int, str] = {}  # request id -> the reason rank 0 rejects it with
        self._fed_from: dict[int, int] = {}  # request id -> slot of the last command's decode rows
        self._uncollected: list[int] = []  # handles of steps not read yet, oldest first
        self._sent = 0  # the last handle given out
        self._results: dict[int, tuple[Command, Reply]] = {}
        self._feeds: dict[int, int] = {}  # request id -> slot the last prefill fed
        self.most_in_flight = 0
        self.snapshots: dict[int, tuple[int, int, list[int]]] = {}  # slot -> key, position, fed
        self.page_tokens: dict[tuple[int, int], int] = {}  # (page, offset) -> token written there
        self.restores = 0

    # -- helpers ----------------------------------------------------------------------------

    def live_requests(self) -> set[int]:
        return set(self.staging) | set(self.slot_state)

    def _check_pages(self, request_id: int, state: _State, pages: list[int], tokens: int) -> None:
        expected = -(-tokens // self.capacity.page_size)
        if len(pages) != expected:
            raise RankStateError(f"request {request_id}: {len(pages)} pages for {tokens} positions")
        if pages[: len(state.pages)] != state.pages[: len(pages)]:
            raise RankStateError(f"request {request_id}: page table changed")
        for page in pages:
            if not 0 <= page < self.capacity.kv_pages:
                raise RankStateError(f"request {request_id}: page {page} out of range")
        state.pages = pages

    def _write(self, request_id: int, state: _State, tokens: list[int], start: int) -> None:
        """Write the tokens' KV at positions ``start..``: into pages no other live request holds."""
        size = self.capacity.page_size
        written = {state.pages[position // size] for position in range(start, start + len(tokens))}
        for other_id, other in (self.staging | self.slot_state).items():
            if other_id != request_id and written & set(other.pages):
                raise RankStateError(f"request {request_id} writes pages request {other_id} holds")
        for position, token in enumerate(tokens, start=start):
            self.page_tokens[state.pages[position // size], position % size] = token
        state.fed.extend(tokens)

    def _restore(self, chunk: PrefillChunk, restore: StateSnapshot) -> None:
        held = self.snapshots.get(restore.slot)
        if not 0 <= restore.slot < self.capacity.snapshot_slots:
            raise RankStateError(
                f"request {chunk.request_id} restores snapshot slot {restore.slot}: out of range"
            )
        if held is None or held[:2] != (restore.key, restore.position) or chunk.start != restore.position:
            raise RankStateError(f"request {chunk.request_id} restores {restore} but the slot holds {held}")
        if chunk.request_id in self.staging or chunk.request_id in self.slot_state:
            raise RankStateError(f"request {chunk.request_id} restores after its first chunk")
        fed, pages, size = held[2], unpack_list(chunk.page_ids), self.capacity.page_size
        if any(self.page_tokens.get((pages[p // size], p % size)) != fed[p] for p in range(len(fed))):
            raise RankStateError(f"request {chunk.request_id}: cached pages do not hold the restored prefix")
        if len(self.staging) + len(self.slot_state) >= self.capacity.max_slots:
            raise RankStateError("prefill chunks would exceed worker capacity")
        self.staging[chunk.request_id] = _State(fed=list(fed))
        self.restores += 1

    def _save(self, chunk: PrefillChunk, state: _State, end: int) -> None:
        positions = [save.position for save in chunk.save]
        if positions != sorted(set(positions)) or not all(chunk.start < p <= end for p in positions):
            raise RankStateError(
                f"request {chunk.request_id}: saves {positions} outside ({chunk.start}, {end}]"
            )
        if chunk.save and chunk.prompt_logprobs is not None:
            raise RankStateError(f"request {chunk.request_id} saves a chunk that scores its prompt")
        for save in chunk.save:
            if not 0 <= save.slot < self.capacity.snapshot_slots:
                raise RankStateError(f"request {chunk.request_id} saves into slot {save.slot}: out of range")
            self.snapshots[save.slot] = (save.key, save.position, state.fed[: save.position])

    def _not_in_flight(self, op: str) -> None:
        if self._uncollected:
            raise RankStateError(f"{op} sent while {len(self._uncollected)} decode steps are uncollected")
        self._fed_from = {}

    def _check_dense(self) -> None:
        occupied = [owner is not None for owner in self.slot_map]
        if occupied != sorted(occupied, reverse=True):
            raise RankStateError(f"slot map has holes: {self.slot_map}")

    # -- commands ---------------------------------------------------------------------------

    def _prefill(self, chunks: list[PrefillChunk]) -> list[TokenResult]:
        if sum(len(c.tokens) // 4 for c in chunks) > self.capacity.max_batch_tokens:
            raise RankStateError("prefill over the token budget")
        results = []
        for chunk in chunks:  # every restore of the command before any model work or save
            if chunk.restore is not None:
                self._restore(chunk, chunk.restore)
        for chunk in chunks:
            tokens = unpack_list(chunk.tokens)
            if not tokens:
                raise RankStateError(f"empty chunk for request {chunk.request_id}")
            if chunk.request_id in self.slot_state:
                raise RankStateError(f"request {chunk.request_id} is already in decode state")
            if chunk.start == 0:
                if chunk.request_id in self.staging:
                    raise RankStateError(f"request {chunk.request_id} restarted its prefill")
                if len(self.staging) + len(self.slot_state) >= self.capacity.max_slots:
                    raise RankStateError("prefill chunks would exceed worker capacity")
                self.staging[chunk.request_id] = _State()
            state = self.staging.get(chunk.request_id)
            if state is None or state.prompt_done or len(state.fed) != chunk.start:
                raise RankStateError(f"request {chunk.request_id}: chunk start {chunk.start} out of order")
            self._check_pages(chunk.request_id, state, unpack_list(chunk.page_ids), chunk.start + len(tokens))
            self._write(chunk.request_id, state, tokens, chunk.start)
            self._save(chunk, state, chunk.start + len(tokens))
            if chunk.last:
                state.prompt_done = True
                state.last_sampled = fake_token(state.fed, chunk.sampling, self.vocab)
                results.append(TokenResult(chunk.request_id, state.last_sampled))
            if chunk.feed_slot != NO_FEED:
                if not chunk.last or self.slot_map[chunk.feed_slot] is not None:
                    raise RankStateError(f"request {chunk.request_id} feeds slot {chunk.feed_slot} wrongly")
                self._feeds[chunk.request_id] = chunk.feed_slot
        return results

    def _decode(self, rows: list[DecodeRow]) -> list[TokenResult]:
        results = []
        for index, row in enumerate(rows):
            if row.slot != index:
                raise RankStateError(f"row {index} uses slot {row.slot}")
            owner = self.slot_map[row.slot]
            if owner is None:
                state = self.staging.pop(row.request_id, None)
                if state is None or not state.prompt_done:
                    raise RankStateError(f"request {row.request_id} is not ready for decode")
                self.slot_map[row.slot] = row.request_id
                self.slot_state[row.request_id] = state
            elif owner != row.request_id:
                raise RankStateError(f"slot {row.slot} owned by {owner}, row names {row.request_id}")
            state = self.slot_state[row.request_id]
            if row.token == FED_TOKEN:
                if self._fed_from.get(row.request_id) != row.slot:
                    raise RankStateError(f"request {row.request_id}: fed token without a decode before")
                row = DecodeRow(
                    row.request_id, row.slot, state.last_sampled, row.position, row.page_ids, row.sampling
                )
            if row.token != state.last_sampled or row.position != len(state.fed):
                raise RankStateError(f"request {row.request_id}: wrong token or position {row.position}")
            self._check_pages(row.request_id, state, unpack_list(row.page_ids), row.position + 1)
            self._write(row.request_id, state, [row.token], row.position)
            state.last_sampled = fake_token(state.fed, row.sampling, self.vocab)
            results.append(TokenResult(row.request_id, state.last_sampled))
        if len(rows) != sum(owner is not None for owner in self.slot_map):
            raise RankStateError("decode does not cover every occupied slot")
        self._check_dense()
        self._fed_from = {row.request_id: row.slot for row in rows}
        return results

    def send(self, command: Command) -> int:
        """Carry ``command`` out now and hold its reply for ``collect``; returns its handle."""
        match command:
            case Prefill(chunks=chunks):
                return self._hold(command, self._prefill_step(chunks))
            case Decode(rows=rows):
                self.commands.append(("decode", rows))
                return self._hold(command, DecodeDone(results=list(reversed(self._decode(rows)))))
            case Unified(prefill=chunks, decode=rows):
                return self._hold(command, self._unified(chunks, rows))
            case DropRequest():
                return self._hold(command, DropAck(self._drop(command)))
            case Ping():
                return self._hold(command, Ack())
        raise RankStateError(f"the fake ranks do not run {type(command).__name__}")

    def collect(self, handle: int) -> Reply:
        """The step's reply, checked against its command by the executor's own validation."""
        if not self._uncollected or self._uncollected[0] != handle:
            raise RankStateError(f"step {handle} collected out of order (in flight: {self._uncollected})")
        self._uncollected.pop(0)
        command, reply = self._results.pop(handle)
        return validate(command, [ReplyEnvelope(PROTOCOL_VERSION, 0, 0, handle, reply)], world_size=1)

    def _hold(self, command: Command, reply: Reply) -> int:
        self._sent += 1
        handle = self._sent
        self._results[handle] = (command, self._rejecting(command, reply))
        self._uncollected.append(handle)
        self.most_in_flight = max(self.most_in_flight, len(self._uncollected))
        return handle

    def _rejecting(self, command: Command, reply: Reply) -> Reply:
        """The reply once rank 0 rejects the requests of ``rejects`` that the command carries."""
        if not isinstance(reply, PrefillDone | DecodeDone | UnifiedDone):
            return reply
        chunks = command.chunks if isinstance(command, Prefill) else getattr(command, "prefill", [])
        rows = command.rows if isinstance(command, Decode) else getattr(command, "decode", [])
        carried = [chunk.request_id for chunk in chunks] + [row.request_id for row in rows]
        rejected = [RequestRejected(rid, self.rejects[rid]) for rid in carried if rid in self.rejects]

        def kept(results: list[TokenResult]) -> list[TokenResult]:
            return [result for result in results if result.request_id not in self.rejects]

        if isinstance(reply, PrefillDone):
            return PrefillDone(kept(reply.results), reply.prompt_logprobs, rejected)
        if isinstance(reply, DecodeDone):
            return DecodeDone(kept(reply.results), rejected)
        return UnifiedDone(kept(reply.prefill), kept(reply.decode), reply.prompt_logprobs, rejected)

    def _prefill_step(self, chunks: list[PrefillChunk]) -> PrefillDone:
        self.commands.append(("prefill", chunks))
        self._not_in_flight("prefill")
        self._feeds = {}
        done = PrefillDone(results=list(reversed(self._prefill(chunks))))
        self._fed_from = dict(self._feeds)
        return done

    def _unified(self, chunks: list[PrefillChunk], rows: list[DecodeRow]) -> UnifiedDone:
        self.commands.append(("unified", (chunks, rows)))
        if not chunks or not rows:
            raise RankStateError("unified step needs both halves")
        if {c.request_id for c in chunks} & {r.request_id for r in rows}:
            raise RankStateError("request in both prefill and decode")
        return UnifiedDone(prefill=self._prefill(chunks), decode=self._decode(rows))

    def _drop(self, command: DropRequest) -> bool:
        """Carry the drop out; returns whether the request existed."""
        request_id, expectation, move = command.request_id, command.expectation, command.move
        self.commands.append(("drop", (request_id, expectation, move)))
        self._not_in_flight("drop")
        if request_id == self.fail_on_drop_of:
            raise RankStateError(f"injected drop failure for request {request_id}")
        existed = request_id in self.live_requests()
        if existed != (expectation is Expectation.MUST_EXIST):
            raise RankStateError(f"drop of {request_id} expected {expectation}, existed={existed}")
        if request_id in self.staging:
            if move is not None:
                raise RankStateError(f"drop of staged request {request_id} carries a slot compaction")
            del self.staging[request_id]
            return existed
        if not existed:
            if move is not None:
                raise RankStateError(f"drop of absent request {request_id} carries a slot compaction")
            return existed
        del self.slot_state[request_id]
        slot = self.slot_map.index(request_id)
        if move is None:
            self.slot_map[slot] = None
        else:
            if move.to_slot != slot or self.slot_map[move.from_slot] != move.request_id:
                raise RankStateError(f"bad compaction {move} for slot map {self.slot_map}")
            self.slot_map[move.to_slot] = move.request_id
            self.slot_map[move.from_slot] = None
        self._check_dense()
        return existed
