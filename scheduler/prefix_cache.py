"""The prefix cache: KV pages shared by content, and snapshots of the linear-attention state.

A hybrid model's cache is two things. The attention layers' KV pages are shared per full page:
block i of a prompt (its tokens ``i*page_size .. (i+1)*page_size - 1``) is named by a key chained
over the blocks before it, so equal keys mean equal prefixes. The Gated DeltaNet layers keep one
fixed-size state, which can only be reused where the ranks took a snapshot of it
(``StateSnapshot``). A hit at position P (a page boundary, at most ``len(prompt) - 1`` so that one
prompt token is still prefilled and gives the first token's logits) needs the pages of blocks
``0 .. P/page_size - 1`` cached and a snapshot of the state after P tokens.

Pages: the cache and the ``PagePool`` share one budget. A cached block owns its page; blocks no
request references are evictable, least recently released first (a request releases its deepest
block first, so deeper blocks go before their parents). Admission counts free and evictable pages,
so it stays exact: a request still reserves every page it can ever need, its hit pages referenced
rather than allocated again.

Snapshots: a key (of the last block before P) -> a snapshot slot, least recently used first out.
A slot is pending from the chunk that saves into it until that chunk is answered, and pinned from
the admission of a request that restores it until that request's first chunk is sent (ranks run a
command's restores before its saves, and commands in order, so a later save may overwrite it).

Blocks and snapshots become hit-able only when the chunk that wrote them is answered, so a hit
never reads state saved in the same or a later command.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import SNAPSHOT_GRID, StateSnapshot
from phalanx.scheduler.pages import PagePool

_ROOT_KEY = 0  # the key "before" block 0


def block_keys(prompt: list[int], page_size: int) -> list[int]:
    """The key of each full block of ``prompt``: a signed 64-bit blake2b digest of the previous
    block's key and the block's token ids (little-endian int32)."""
    tokens, width = pack_ids(prompt), 4 * page_size
    keys, key = [], _ROOT_KEY
    for start in range(0, len(tokens) - width + 1, width):
        digest = hashlib.blake2b(key.to_bytes(8, "little", signed=True), digest_size=8)
        digest.update(tokens[start : start + width])
        key = int.from_bytes(digest.digest(), "little", signed=True)
        keys.append(key)
    return keys


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int = 0  # admissions looked up (requests that ask for prompt logprobs are not)
    hits: int = 0  # admissions that restored a cached prefix
    hit_tokens: int = 0  # prompt tokens those hits did not prefill
    evicted_pages: int = 0
    evicted_snapshots: int = 0
    cached_pages: int = 0  # pages the cache owns (referenced or evictable)


@dataclass
class PrefixState:
    """One request's part in the cache."""

    keys: list[int] = field(default_factory=list)  # each full prompt block's key (cache on only)
    hit: int = 0  # prompt positions restored from the cache
    restore: StateSnapshot | None = None  # pinned until the request's first chunk is planned
    shared: list[int] = field(default_factory=list)  # keys of the cached blocks it references
    looked_at: int = 0  # leading blocks already registered (or found cached under another page)


@dataclass
class _Block:
    page: int
    refs: int


class PrefixCache:
    def __init__(self, pool: PagePool, snapshot_slots: int, snapshot_interval: int) -> None:
        if snapshot_interval < 1:
            raise ValueError(f"prefix_snapshot_interval must be positive, got {snapshot_interval}")
        self.pool = pool
        self.enabled = snapshot_slots > 0
        # Snapshots sit at page boundaries, on the ranks' free grid where the prompt reaches it.
        self.grid = math.lcm(pool.page_size, SNAPSHOT_GRID)
        step = self.grid if snapshot_interval >= self.grid else pool.page_size
        self.snapshot_interval = max(snapshot_interval // step, 1) * step
        self._blocks: dict[int, _Block] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced block keys, LRU first
        self._free_slots = list(range(snapshot_slots - 1, -1, -1))
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # registered: key -> slot, LRU first
        self._pending: dict[int, int] = {}  # key -> slot saved by a chunk not answered yet
        self._pins: dict[int, int] = {}  # key -> admitted requests that will restore it
        self.queries = self.hits = self.hit_tokens = self.evicted_pages = self.evicted_snapshots = 0

    # -- budget -----------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Pages a request could get now: free ones and evictable cached ones."""
        return self.pool.free + len(self._evictable)

    @property
    def referenced_pages(self) -> int:
        """Cached pages some request references (they count as used, like the pool's own)."""
        return len(self._blocks) - len(self._evictable)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh pages, evicting least recently used cached blocks for those not free."""
        while self.pool.free < count and self._evictable:
            key, _ = self._evictable.popitem(last=False)
            self.pool.give_back([self._blocks.pop(key).page])
            self.evicted_pages += 1
        return self.pool.allocate(count)

    # -- admission --------------------------------------------------------------------------

    def admit(self, state: PrefixState, prompt: list[int], needed: int, scored: bool) -> list[int] | None:
        """Reserve the ``needed`` pages of a new request, the cached prefix's among them (the
        request's cursor starts at ``state.hit``); None when they do not fit now. ``scored``: the
        request asks for prompt logprobs, which need every prompt position's logits, so it never
        hits."""
        if self.enabled and not state.keys:
            state.keys = block_keys(prompt, self.pool.page_size)
        hit, restore = self._find_hit(state.keys, len(prompt)) if self.enabled and not scored else (0, None)
        hit_keys = state.keys[: hit // self.pool.page_size]
        idle_hits = sum(self._blocks[key].refs == 0 for key in hit_keys)
        if needed - len(hit_keys) > self.available - idle_hits:
            return None
        if self.enabled and not scored:
            self.queries += 1
        for key in hit_keys:
            self._ref(key)
        state.hit, state.restore, state.shared, state.looked_at = hit, restore, hit_keys, len(hit_keys)
        if restore is not None:
            self._pins[restore.key] = self._pins.get(restore.key, 0) + 1
            self._snapshots.move_to_end(restore.key)
            self.hits += 1
            self.hit_tokens += hit
        hit_pages = [self._blocks[key].page for key in hit_keys]
        return hit_pages + self.allocate(needed - len(hit_keys))

    def _find_hit(self, keys: list[int], prompt_length: int) -> tuple[int, StateSnapshot | None]:
        """The deepest page boundary P <= ``prompt_length - 1`` whose blocks are all cached and
        whose state is snapshotted, with that snapshot; (0, None) when there is none."""
        cached = 0
        while cached < len(keys) and keys[cached] in self._blocks:
            cached += 1
        for blocks in range(min(cached, (prompt_length - 1) // self.pool.page_size), 0, -1):
            slot = self._snapshots.get(keys[blocks - 1])
            if slot is not None:
                position = blocks * self.pool.page_size
                return position, StateSnapshot(slot, keys[blocks - 1], position)
        return 0, None

    def restore_planned(self, state: PrefixState) -> StateSnapshot | None:
        """The restore the request's first chunk carries; its snapshot may be overwritten by the
        saves of this command on (the ranks restore first)."""
        restore, state.restore = state.restore, None
        if restore is not None:
            self._unpin(restore.key)
        return restore

    # -- saves ------------------------------------------------------------------------------

    def saves(self, state: PrefixState, prompt_length: int, start: int, end: int) -> list[StateSnapshot]:
        """The snapshots a chunk covering prompt positions ``[start, end)`` takes: at the save
        points in ``(start, end]`` that the cache does not hold yet (those it holds are touched)."""
        if not self.enabled:
            return []
        saves = []
        for position in self._save_points(prompt_length, start, end):
            key = state.keys[position // self.pool.page_size - 1]
            if key in self._snapshots:
                self._snapshots.move_to_end(key)
            elif key not in self._pending:
                slot = self._take_slot()
                if slot is None:
                    break  # every slot is pending or pinned: later points would not fit either
                self._pending[key] = slot
                saves.append(StateSnapshot(slot, key, position))
        return saves

    def _save_points(self, prompt_length: int, start: int, end: int) -> list[int]:
        """Every multiple of the interval and the last grid point before the prompt's last token
        (its last page boundary if it reaches no grid point), within ``(start, end]``."""
        last = (prompt_length - 1) // self.grid * self.grid or (
            prompt_length - 1
        ) // self.pool.page_size * self.pool.page_size
        first = (start // self.snapshot_interval + 1) * self.snapshot_interval
        points = list(range(first, min(end, last) + 1, self.snapshot_interval))
        if last > 0 and start < last <= end and last not in points:
            points.append(last)
        return points

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for key in self._snapshots:
            if key not in self._pins:
                self.evicted_snapshots += 1
                return self._snapshots.pop(key)
        return None

    # -- answers ----------------------------------------------------------------------------

    def answered(self, state: PrefixState, pages: list[int], end: int, saves: list[StateSnapshot]) -> None:
        """A chunk of the request ending at prompt position ``end`` was answered: its full blocks
        and its snapshots become hit-able."""
        for snapshot in saves:
            del self._pending[snapshot.key]
            self._snapshots[snapshot.key] = snapshot.slot
        if not self.enabled:
            return
        for index in range(state.looked_at, min(end // self.pool.page_size, len(state.keys))):
            key = state.keys[index]
            if key not in self._blocks:  # else cached under another request's page: keep ours
                self.pool.hand_over([pages[index]])
                self._blocks[key] = _Block(pages[index], refs=1)
                state.shared.append(key)
        state.looked_at = max(state.looked_at, end // self.pool.page_size)

    def abandoned(self, saves: list[StateSnapshot]) -> None:
        """A chunk was answered but rejected (its request ran with stand-in values): nothing it
        wrote is the prompt's, so its saves' slots go back free and its blocks stay uncached."""
        for snapshot in saves:
            self._free_slots.append(self._pending.pop(snapshot.key))

    # -- release ----------------------------------------------------------------------------

    def release(self, state: PrefixState, pages: list[int]) -> None:
        """The request is gone: its own pages go back to the pool, its cached ones lose a
        reference (deepest first, so they are evicted first)."""
        if state.restore is not None:
            self._unpin(state.restore.key)
            state.restore = None
        shared = {self._blocks[key].page for key in state.shared}
        self.pool.release([page for page in pages if page not in shared])
        for key in reversed(state.shared):
            block = self._blocks[key]
            block.refs -= 1
            if block.refs == 0:
                self._evictable[key] = None
        state.shared = []

    def _ref(self, key: int) -> None:
        block = self._blocks[key]
        block.refs += 1
        self._evictable.pop(key, None)

    def _unpin(self, key: int) -> None:
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]

    # -- inspection -------------------------------------------------------------------------

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.queries,
            self.hits,
            self.hit_tokens,
            self.evicted_pages,
            self.evicted_snapshots,
            cached_pages=len(self._blocks),
        )

    def check_idle(self) -> None:
        """Raise unless nothing is referenced, pinned or pending (every request has left)."""
        referenced = {key: block.refs for key, block in self._blocks.items() if block.refs}
        if referenced or self._pins or self._pending:
            raise RuntimeError(
                f"prefix cache not idle: referenced blocks {referenced}, pinned snapshots "
                f"{self._pins}, pending saves {self._pending}"
            )
        owned = {block.page for block in self._blocks.values()}
        if len(owned) != len(self._blocks) or owned & set(self.pool.free_pages):
            raise RuntimeError("prefix cache pages are shared between blocks or also free in the pool")
