"""The prefix cache on its own (scheduler/prefix_cache.py): block keys, save points, lookup,
registration on the answer only, reference counts, LRU eviction of pages and snapshots, and the
exact page budget it shares with the pool."""

from __future__ import annotations

import pytest

from phalanx.protocol.messages import INT64_MAX, INT64_MIN, StateSnapshot
from phalanx.scheduler.pages import PagePool
from phalanx.scheduler.prefix_cache import PrefixCache, PrefixState, block_keys

PAGE = 4


def cache(pages: int = 32, slots: int = 4, interval: int = 8) -> PrefixCache:
    return PrefixCache(PagePool(pages, PAGE), slots, interval)


def prefill(
    prefix: PrefixCache, prompt: list[int], needed: int | None = None, scored: bool = False
) -> tuple[PrefixState, list[int]]:
    """Admit a request and answer its whole prompt as one chunk (with the saves it takes)."""
    state = PrefixState()
    pages = prefix.admit(state, prompt, needed or -(-len(prompt) // PAGE), scored)
    assert pages is not None
    restore = prefix.restore_planned(state)
    assert (restore is None) == (state.hit == 0)
    saves = [] if scored else prefix.saves(state, len(prompt), state.hit, len(prompt))
    prefix.answered(state, pages, len(prompt), saves)
    return state, pages


def test_block_keys_chain_full_blocks_deterministically() -> None:
    prompt = list(range(10))
    keys = block_keys(prompt, PAGE)
    assert len(keys) == 2  # the last two tokens fill no block
    assert keys == block_keys(prompt + [99], PAGE) == block_keys(list(range(8)), PAGE)
    assert all(INT64_MIN <= key <= INT64_MAX for key in keys)
    # The same block's tokens at another depth, or after another first block, get another key.
    assert block_keys([4, 5, 6, 7], PAGE)[0] != keys[1]
    assert block_keys([0, 1, 2, 9, 4, 5, 6, 7], PAGE)[1] != keys[1]
    assert block_keys([], PAGE) == block_keys([1, 2, 3], PAGE) == []


@pytest.mark.parametrize(
    ("length", "start", "end", "points"),
    [
        (37, 0, 37, [8, 16, 24, 32, 36]),  # every 8 tokens, and the last boundary before token 36
        (37, 0, 10, [8]),
        (37, 8, 16, [16]),  # (start, end]: a chunk ending at a point takes it
        (37, 16, 33, [24, 32]),
        (37, 33, 37, [36]),
        (33, 0, 33, [8, 16, 24, 32]),  # the last boundary is a multiple of the interval: once
        (32, 0, 32, [8, 16, 24, 28]),  # a full last page: its boundary leaves no token to prefill
        (3, 0, 3, []),
    ],
)
def test_save_points(length: int, start: int, end: int, points: list[int]) -> None:
    assert cache()._save_points(length, start, end) == points


def test_interval_is_rounded_to_whole_pages() -> None:
    assert cache(interval=10).snapshot_interval == 8
    assert cache(interval=3).snapshot_interval == PAGE
    with pytest.raises(ValueError, match="prefix_snapshot_interval must be positive, got 0"):
        cache(interval=0)


def test_a_prefix_is_hit_only_once_the_chunk_that_wrote_it_is_answered() -> None:
    prefix = cache()
    prompt = list(range(20))
    state = PrefixState()
    pages = prefix.admit(state, prompt, 5, scored=False)
    saves = prefix.saves(state, 20, 0, 20)
    assert [(s.slot, s.position) for s in saves] == [(0, 8), (1, 16)]
    assert prefix.admit(PrefixState(), prompt, 5, scored=False) is not None  # sent, not answered
    assert prefix.stats().hits == 0 and prefix.stats().cached_pages == 0
    prefix.answered(state, pages, 20, saves)
    assert prefix.stats().cached_pages == 5

    second = PrefixState()
    assert prefix.admit(second, prompt + [7, 7], 6, scored=False) is not None
    assert (second.hit, second.restore) == (16, StateSnapshot(1, block_keys(prompt, PAGE)[3], 16))
    assert second.shared == block_keys(prompt, PAGE)[:4]
    stats = prefix.stats()
    assert (stats.queries, stats.hits, stats.hit_tokens) == (3, 1, 16)


def test_the_deepest_snapshotted_boundary_before_the_last_token_is_hit() -> None:
    prefix = cache(slots=8, interval=8)
    prefill(prefix, list(range(24)))  # snapshots at 8, 16 and 20; blocks 0..5 cached
    same, _ = prefill(prefix, list(range(24)))
    assert same.hit == 20  # never 24: one prompt token must be prefilled for the logits
    longer, _ = prefill(prefix, list(range(30)))
    assert longer.hit == 20  # no snapshot at 24 yet: this request takes it
    other, _ = prefill(prefix, [*range(10), 0, 0])
    assert other.hit == 8
    assert prefill(prefix, [5, *range(1, 30)])[0].hit == 0


def test_prompt_logprobs_requests_never_hit_nor_save() -> None:
    prefix = cache()
    prefill(prefix, list(range(20)))
    scored, _ = prefill(prefix, list(range(20)), scored=True)
    assert scored.hit == 0 and prefix.stats().queries == 1


def test_shared_blocks_are_referenced_then_evictable_deepest_first() -> None:
    prefix = cache(pages=8)
    first, first_pages = prefill(prefix, list(range(13)))  # blocks 0, 1, 2 cached; 1 page its own
    second, second_pages = prefill(prefix, list(range(13)))
    assert second.hit == 12 and second.shared == first.shared and second_pages[:3] == first_pages[:3]
    assert prefix.referenced_pages == 3 and prefix.available == 8 - 3 - 2
    prefix.release(first, first_pages)
    assert prefix.available == 4  # the blocks are still referenced by the second request
    prefix.release(second, second_pages)
    assert prefix.available == 8
    # The oldest released block first, the deepest of a request's blocks before its parents.
    pages = prefix.allocate(prefix.pool.free + 2)
    assert prefix.stats().evicted_pages == 2
    assert block_keys(list(range(13)), PAGE)[0] in prefix._blocks
    assert len(pages) == 7


def test_admission_counts_free_and_evictable_pages_exactly() -> None:
    prefix = cache(pages=10)
    done, pages = prefill(prefix, list(range(17)), needed=6)  # blocks 0..3 cached, 2 pages its own
    prefix.release(done, pages)
    assert (prefix.pool.free, prefix.available) == (6, 10)
    assert prefix.admit(PrefixState(), [9] * 5, 11, scored=False) is None
    other = PrefixState()
    pages = prefix.admit(other, [9] * 5, 10, scored=False)
    assert len(set(pages)) == 10 and prefix.stats().evicted_pages == 4 and prefix.available == 0
    prefix.release(other, pages)
    assert prefix.pool.free == 10 and prefix.stats().cached_pages == 0  # never answered: not cached
    prefix.check_idle()


def test_idle_hit_blocks_are_not_counted_twice() -> None:
    prefix = cache(pages=6)
    done, pages = prefill(prefix, list(range(17)), needed=5)  # 4 blocks cached, 1 page its own
    prefix.release(done, pages)
    # A hit at 16 references the 4 idle blocks: 2 fresh pages must come from the 2 free ones.
    assert prefix.admit(PrefixState(), list(range(18)), 7, scored=False) is None
    state = PrefixState()
    pages = prefix.admit(state, list(range(18)), 6, scored=False)
    assert state.hit == 16 and len(pages) == 6 and prefix.stats().evicted_pages == 0


def test_snapshots_evict_least_recently_used_but_never_pinned_or_pending() -> None:
    prefix = cache(pages=64, slots=2, interval=64)
    a, _ = prefill(prefix, [1] * 9)  # snapshot at 8
    b, _ = prefill(prefix, [2] * 9)
    pinned = PrefixState()
    prefix.admit(pinned, [1] * 10, 3, scored=False)  # will restore a's snapshot: pinned, touched
    assert pinned.hit == 8
    c, _ = prefill(prefix, [3] * 9)  # evicts b's
    assert prefix.stats().evicted_snapshots == 1
    assert prefill(prefix, [2] * 9)[0].hit == 0
    # Both slots pinned or pending: a save is skipped, nothing is evicted.
    pending = PrefixState()
    prefix.admit(pending, [4] * 9, 3, scored=False)
    assert len(prefix.saves(pending, 9, 0, 9)) == 1  # takes c's slot, then ...
    late = PrefixState()
    prefix.admit(late, [5] * 9, 3, scored=False)
    assert prefix.saves(late, 9, 0, 9) == []
    assert prefix.restore_planned(pinned) == StateSnapshot(0, block_keys([1] * 8, PAGE)[1], 8)
    assert len(prefix.saves(late, 9, 0, 9)) == 1  # unpinned once its restore is planned


def test_a_held_snapshot_is_touched_not_saved_again() -> None:
    prefix = cache(slots=2, interval=64)
    prefill(prefix, [1] * 9)
    prefill(prefix, [2] * 9)
    again = PrefixState()
    prefix.admit(again, [1] * 9, 3, scored=True)  # no hit (scored), but the same save point
    assert prefix.saves(again, 9, 0, 9) == []
    prefill(prefix, [3] * 9)  # evicts [2]'s snapshot, the least recently used
    assert prefill(prefix, [1] * 10)[0].hit == 8


def test_the_same_block_answered_twice_keeps_the_first_page() -> None:
    prefix = cache(pages=8)
    one, two = PrefixState(), PrefixState()
    pages_one = prefix.admit(one, list(range(9)), 3, scored=False)
    pages_two = prefix.admit(two, list(range(9)), 3, scored=False)
    saves_one = prefix.saves(one, 9, 0, 9)
    assert prefix.saves(two, 9, 0, 9) == []  # the save is pending: not taken twice
    prefix.answered(one, pages_one, 9, saves_one)
    prefix.answered(two, pages_two, 9, [])
    assert two.shared == [] and prefix.stats().cached_pages == 2
    prefix.release(two, pages_two)
    prefix.release(one, pages_one)
    assert prefix.pool.free == 6
    prefix.check_idle()


def test_disabled_cache_is_a_plain_pool() -> None:
    prefix = cache(pages=8, slots=0)
    state, pages = prefill(prefix, list(range(20)))
    assert state.keys == [] and state.hit == 0 and prefix.stats().cached_pages == 0
    assert prefix.saves(state, 20, 0, 20) == []
    prefix.release(state, pages)
    assert prefix.pool.free == 8 and prefix.stats().queries == 0
