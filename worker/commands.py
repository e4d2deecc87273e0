"""Checking and executing the step commands on one rank: Prefill, Decode, Unified, DropRequest.

Every command is first checked against this rank's state (unknown request, phase, cached
length, page coverage, slot owner, what a restored snapshot slot holds); a mismatch raises
WorkerStateError before any model work. The same planning judges each request's own values
(``worker/step_plans.py``; rank 0 also compiles the grammars there): a request this rank cannot
serve is rejected alone, its chunk or row run with harmless values in place, and rank 0 answers it
in the reply's ``rejected``. A prefill's model work, with the prefix cache's restores and saves,
runs in ``worker/prefill_waves.py``; the snapshot checks are ``worker/snapshots.py``'s.
Rank 0 samples and returns TokenResults; other ranks return None (the loop answers Ack). A Decode
or Unified on rank 0 returns its step still in flight (``PendingStep``, ``worker/pending_steps.py``):
the loop answers it once its tokens are on the host, after launching the next Decode or Unified if
that one arrives first.

Pipelined rows (``FED_TOKEN``) feed the token sampled for their request by the previous command:
a decode row's, or a Prefill's last chunk that named the slot (``feed_slot``), so a request's first
decode can follow its prefill unread. Every rank keeps those tokens on the device, indexed by
decode slot (``fed_tokens``): rank 0 writes them as it samples; before a step with fed rows, it
broadcasts them to the other ranks.
"""

from __future__ import annotations

import torch

from phalanx.kernels.host_staging_triton import feed_tokens
from phalanx.kernels.upload import to_device
from phalanx.models.qwen35 import DecodeBatch
from phalanx.protocol.codec import unpack_list
from phalanx.protocol.messages import (
    FED_TOKEN,
    NO_FEED,
    DecodeRow,
    DropRequest,
    PrefillChunk,
    PrefillDone,
)
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.faults import fault_point
from phalanx.worker.grammar import GrammarTable
from phalanx.worker.graphs import DecodeGraphRunner
from phalanx.worker.pending_steps import PendingDecode, PendingPrefill, PendingUnified
from phalanx.worker.prefill_graphs import PrefillGraphRunner
from phalanx.worker.prefill_waves import run_prefill
from phalanx.worker.request_table import Phase, RequestTable, SlotTable
from phalanx.worker.sampling import DrawnTokens, draw_tokens
from phalanx.worker.snapshots import SnapshotTable, check_distinct_save_slots, check_restore, check_saves
from phalanx.worker.step_plans import ChunkPlan, RowPlan, judge_chunk, judge_row, rejections


class StepRunner:
    def __init__(
        self,
        model,
        device: torch.device,
        rank: int,
        page_size: int,
        kv_pages: int,
        max_slots: int,
        max_batch_tokens: int,
        snapshots: SnapshotTable | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.rank = rank
        self.page_size = page_size
        self.kv_pages = kv_pages  # page id kv_pages is the padding page
        self.max_batch_tokens = max_batch_tokens
        self.requests = RequestTable(max_slots)
        self.slots = SlotTable(max_slots)
        self.snapshots = SnapshotTable() if snapshots is None else snapshots  # none: the prefix cache is off
        self.graphs: DecodeGraphRunner | None = None  # set in graph mode (worker.graphs)
        self.prefill_graphs: PrefillGraphRunner | None = None  # graph mode, one rank (worker.prefill_graphs)
        self.grammars: GrammarTable | None = None  # rank 0's constrained requests (worker.grammar)
        self._fed_tokens = torch.zeros(max_slots, dtype=torch.int64, device=device)
        # request id -> decode slot of every decode row of the previous command: the rows a
        # pipelined step may feed from (empty after any other command).
        self._fed_from: dict[int, int] = {}

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def fed_tokens(self) -> torch.Tensor:
        """The last token sampled in each decode slot (rank 0 writes it; the others get a copy)."""
        return self.graphs.inputs.fed_tokens if self.graphs is not None else self._fed_tokens

    # -- checks ---------------------------------------------------------------------------------

    def _pages(self, request_id: int, packed: bytes, tokens_covered: int) -> list[int]:
        pages = unpack_list(packed)
        needed = -(-tokens_covered // self.page_size)
        if len(pages) < needed:
            raise WorkerStateError(
                f"page table of request {request_id} has {len(pages)} pages; "
                f"{needed} are needed for {tokens_covered} tokens"
            )
        for page in pages:
            if not 0 <= page <= self.kv_pages:
                raise WorkerStateError(
                    f"page id {page} of request {request_id} is outside the KV pool of {self.kv_pages} pages"
                )
        return pages

    @staticmethod
    def _unique(op: str, request_ids: list[int]) -> None:
        seen: set[int] = set()
        for request_id in request_ids:
            if request_id in seen:
                raise WorkerStateError(f"duplicate request id {request_id} in one {op} command")
            seen.add(request_id)

    def _plan_prefill(self, chunks: list[PrefillChunk]) -> list[ChunkPlan]:
        self._unique("prefill", [chunk.request_id for chunk in chunks])
        total = 0
        plans = []
        for chunk in chunks:
            tokens = unpack_list(chunk.tokens)
            if not tokens:
                raise WorkerStateError(f"prefill chunk for request {chunk.request_id} is empty")
            total += len(tokens)
            if chunk.restore is not None:
                check_restore(chunk, self.page_size, self.snapshots)
                state = self.requests.begin(chunk.request_id, chunk.start)
            elif chunk.start == 0:
                state = self.requests.begin(chunk.request_id)
            else:
                state = self.requests.require(chunk.request_id, "prefill")
                if state.phase is not Phase.PREFILLING:
                    raise WorkerStateError(
                        f"request {chunk.request_id} is already in {state.phase.value} state"
                    )
                if state.cached != chunk.start:
                    raise WorkerStateError(
                        f"prefill chunk for request {chunk.request_id} starts at {chunk.start} "
                        f"but {state.cached} tokens are cached"
                    )
            pages = self._pages(chunk.request_id, chunk.page_ids, chunk.start + len(tokens))
            self._check_feed_slot(chunk)
            self._check_grammar(chunk)
            check_saves(chunk, len(tokens), self.snapshots)
            chunk, tokens, rejected = judge_chunk(chunk, tokens, self.vocab_size)
            rejected = rejected or self._start_grammar(chunk)
            plans.append(ChunkPlan(chunk, state, tokens, pages, rejected))
        check_distinct_save_slots("prefill", chunks)
        if total > self.max_batch_tokens:
            raise WorkerStateError(
                f"prefill of {total} tokens exceeds worker max_batch_tokens {self.max_batch_tokens}"
            )
        return plans

    def _check_feed_slot(self, chunk: PrefillChunk) -> None:
        slot = chunk.feed_slot
        if slot == NO_FEED:
            return
        where = f"prefill chunk for request {chunk.request_id} feeds slot {slot}"
        if not chunk.last:
            raise WorkerStateError(f"{where} but is not its prompt's last chunk")
        if not 0 <= slot < len(self.slots):
            raise WorkerStateError(f"{where} outside the worker slot map of {len(self.slots)}")
        owner = self.slots.owner(slot)
        if owner is not None:
            raise WorkerStateError(f"{where}, which request {owner} holds")

    def _check_grammar(self, chunk: PrefillChunk) -> None:
        if chunk.grammar is None:
            return
        if not chunk.last:
            raise WorkerStateError(
                f"prefill chunk for request {chunk.request_id} carries a grammar but is not its last"
            )
        if self.rank == 0 and self.grammars is None:
            raise WorkerStateError(
                f"request {chunk.request_id} carries a grammar but rank 0 has no grammar table"
            )

    def _start_grammar(self, chunk: PrefillChunk) -> str | None:
        """Rank 0 compiles the chunk's grammar before any model work; returns why it does not."""
        if chunk.grammar is None or self.grammars is None:
            return None
        return self.grammars.start(chunk.request_id, chunk.grammar)

    def _constrained(self, request_ids: list[int]) -> torch.Tensor | None:
        """The ids each row may pick, if any row's request has a grammar (rank 0)."""
        return None if self.grammars is None else self.grammars.allowed(request_ids, self.device)

    def _advance_grammars(self, request_ids: list[int], drawn: DrawnTokens) -> None:
        if self.grammars is not None:  # the next mask feeds them, once the next forward is launched
            self.grammars.defer(request_ids, drawn)

    def _plan_decode(self, rows: list[DecodeRow]) -> list[RowPlan]:
        self._unique("decode", [row.request_id for row in rows])
        plans = []
        for row in rows:
            state = self.requests.require(row.request_id, "decode")
            if state.phase is Phase.PREFILLING:
                raise WorkerStateError(f"request {row.request_id} is not ready for decode")
            if row.position != state.cached:
                raise WorkerStateError(
                    f"decode row of request {row.request_id} is at position {row.position} "
                    f"but {state.cached} tokens are cached"
                )
            if row.token == FED_TOKEN and self._fed_from.get(row.request_id) != row.slot:
                raise WorkerStateError(
                    f"decode row of request {row.request_id} feeds the token sampled by the previous "
                    f"command, which did not decode the request in slot {row.slot}"
                )
            if state.phase is Phase.PREFILLED:
                self.slots.admit(row.slot, row.request_id)
            elif state.decode_slot != row.slot:
                raise WorkerStateError(
                    f"decode row of request {row.request_id} carries slot {row.slot} "
                    f"but the request lives in slot {state.decode_slot}"
                )
            pages = self._pages(row.request_id, row.page_ids, row.position + 1)
            judged, rejected = judge_row(row, self.vocab_size)
            plans.append(RowPlan(judged, state, pages, rejected))
        return plans

    # -- execution ------------------------------------------------------------------------------

    def _run_prefill(self, plans: list[ChunkPlan]) -> PendingPrefill | None:
        output = run_prefill(self.model, plans, self.device, self.snapshots, self.prefill_graphs)
        for plan in plans:
            plan.state.cached = plan.chunk.start + len(plan.tokens)
            if plan.chunk.last:
                plan.state.phase = Phase.PREFILLED
        if self.rank != 0:
            return None
        prompt_logprobs = output.prompt_logprobs()
        final = [index for index, plan in enumerate(plans) if plan.chunk.last]
        if not final:
            return PendingPrefill([], None, prompt_logprobs, rejections(plans))
        final_ids = [plans[i].chunk.request_id for i in final]
        allowed = self._constrained(final_ids)
        # A slice, not a list index, where every chunk ends: indexing by a list copies it to the
        # device, which waits for the pass before the sampling's launches are queued behind it
        logits = output.logits if len(final) == len(plans) else output.logits[final]
        drawn = draw_tokens(
            logits,
            [plans[i].chunk.sampling for i in final],
            [plans[i].state.cached for i in final],
            allowed=allowed,
        )
        if allowed is not None:
            self._advance_grammars(final_ids, drawn)
        feeding = [
            (row, plans[i].chunk.feed_slot)
            for row, i in enumerate(final)
            if plans[i].chunk.feed_slot != NO_FEED
        ]
        if feeding:  # the first decode rows may follow unread (FED_TOKEN): keep their tokens here
            picked = to_device(torch.tensor([row for row, _ in feeding]), drawn.tokens.device)
            slots = to_device(torch.tensor([slot for _, slot in feeding]), self.fed_tokens.device)
            self.fed_tokens.index_copy_(0, slots, drawn.tokens.index_select(0, picked))
        return PendingPrefill(final_ids, drawn, prompt_logprobs, rejections(plans))

    def _run_decode(self, plans: list[RowPlan]) -> PendingDecode | None:
        for plan in plans:
            if plan.state.phase is Phase.PREFILLED:
                self.model.copy_state(plan.state.state_slot, plan.row.slot)
                self.requests.promote(plan.state, plan.row.slot)
        rows = [(plan.row.token, plan.row.position, plan.row.slot, plan.pages) for plan in plans]
        fed = any(plan.row.token == FED_TOKEN for plan in plans)
        if fed:
            self.model.tp.broadcast_from_first(self.fed_tokens)
        greedy = None  # every row's argmax, when the graph runner picked it (and fed it) already
        landed = None  # and where those tokens land on the host, when a graph replay put them there
        if self.graphs is not None:
            occupied = [slot for slot, owner in enumerate(self.slots.owners) if owner is not None]
            logits = self.graphs.decode(DecodeBatch.build(rows), occupied)
            slots = self.graphs.inputs.slots[: len(rows)]  # the staged rows' slots, on the device
            greedy, landed = self.graphs.greedy_tokens(), self.graphs.landed_tokens()
        else:
            batch = DecodeBatch.build(rows, self.device)
            if fed:
                batch.tokens = feed_tokens(batch.tokens, batch.state_slots, self.fed_tokens)
            logits, slots = self.model.decode(batch), batch.state_slots
        for plan in plans:
            plan.state.cached += 1
        self._fed_from = {plan.row.request_id: plan.row.slot for plan in plans}
        if self.rank != 0:
            return None
        request_ids = [plan.row.request_id for plan in plans]
        allowed = self._constrained(request_ids)
        drawn = draw_tokens(
            logits,
            [plan.row.sampling for plan in plans],
            [plan.row.position + 1 for plan in plans],
            greedy,
            landed,
            allowed,
        )
        if allowed is not None:
            self._advance_grammars(request_ids, drawn)
        if drawn.tokens is not greedy:
            self.fed_tokens.index_copy_(0, slots, drawn.tokens)
        return PendingDecode(plans, drawn)

    # -- commands -------------------------------------------------------------------------------

    def prefill(self, chunks: list[PrefillChunk]) -> PrefillDone | None:
        fault_point("prefill", self.rank)
        pending = self._run_prefill(self._plan_prefill(chunks))
        self._fed_from = {chunk.request_id: chunk.feed_slot for chunk in chunks if chunk.feed_slot != NO_FEED}
        if pending is None:
            return None
        return PrefillDone(pending.results(), pending.prompt_logprobs, pending.rejected)

    def decode(self, rows: list[DecodeRow]) -> PendingDecode | None:
        """Launches the step; rank 0 gets it back in flight (``PendingDecode.results``)."""
        fault_point("decode", self.rank)
        return self._run_decode(self._plan_decode(rows))

    def unified(self, chunks: list[PrefillChunk], rows: list[DecodeRow]) -> PendingUnified | None:
        """Decode, then prefill; both halves are checked before either runs. Rank 0 gets the step
        back in flight (``PendingUnified.reply``)."""
        fault_point("unified", self.rank)
        for chunk in chunks:
            if chunk.feed_slot != NO_FEED:
                raise WorkerStateError(
                    f"unified chunk for request {chunk.request_id} feeds slot {chunk.feed_slot}: "
                    "only a prefill may feed a decode slot"
                )
        prefill_ids = {chunk.request_id for chunk in chunks}
        for row in rows:
            if row.request_id in prefill_ids:
                raise WorkerStateError(f"request {row.request_id} appears in both prefill and decode")
        decode_plans = self._plan_decode(rows)
        prefill_plans = self._plan_prefill(chunks)
        # Decode first: its graph replay is one launch, so the GPU runs it while the host is still
        # launching the prefill's kernels one by one (the halves touch disjoint requests).
        decode_step = self._run_decode(decode_plans)
        prefill_step = self._run_prefill(prefill_plans)
        if prefill_step is None or decode_step is None:
            return None
        return PendingUnified(prefill_step, decode_step)

    def drop(self, command: DropRequest) -> bool:
        """Forget a request (and apply the slot compaction); returns whether it existed here."""
        fault_point("drop", self.rank)
        self._fed_from = {}
        if self.grammars is not None:
            self.grammars.drop(command.request_id)
        state = self.requests.get(command.request_id)
        if command.move is None:
            if state is not None and state.phase is Phase.DECODING and state.decode_slot is not None:
                self.slots.release(state.decode_slot, command.request_id)
            self.requests.remove(command.request_id)
            return state is not None
        if state is None:
            raise WorkerStateError(f"drop of absent request {command.request_id} carries a slot compaction")
        move = command.move
        if state.phase is Phase.DECODING and state.decode_slot != move.to_slot:
            raise WorkerStateError(
                f"request {command.request_id} lives in slot {state.decode_slot} "
                f"but the scheduler dropped it from slot {move.to_slot}"
            )
        moved = self.requests.require(move.request_id, "moved")
        if moved.phase is Phase.DECODING and moved.decode_slot != move.from_slot:
            raise WorkerStateError(
                f"request {move.request_id} lives in slot {moved.decode_slot} "
                f"but the scheduler moved it from slot {move.from_slot}"
            )
        if self.slots.compact(command.request_id, move.request_id, move.from_slot, move.to_slot):
            self.model.copy_state(move.from_slot, move.to_slot)
            moved.decode_slot = move.to_slot
        self.requests.remove(command.request_id)
        return True
