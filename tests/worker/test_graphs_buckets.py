"""Decode buckets and the graph slot reserve sizing (pure functions)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.protocol.buckets import DECODE_BUCKETS, bucket_for, buckets_up_to
from phalanx.worker.buckets import size_graph_slot_reserve, smaller_bucket

MIB = 2**20


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64, 65, 129, 256)] == [
        1, 2, 4, 4, 8, 8, 16, 64, 64, 128, 256, 256,
    ]  # fmt: skip


def test_bucket_for_rejects_empty_and_oversized_batches() -> None:
    with pytest.raises(ValueError, match="decode batch of 0 rows has no bucket"):
        bucket_for(0)
    with pytest.raises(ValueError, match="decode batch of 257 rows exceeds the largest graph bucket 256"):
        bucket_for(257)


def test_buckets_up_to_the_effective_batch_bucket() -> None:
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(5) == (1, 2, 4, 8)
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_up_to(200) == DECODE_BUCKETS
    assert smaller_bucket(64) == 32 and smaller_bucket(1) is None


def _capacity(requested: int, per_request: int):
    """The ordinary capacity math: at most ``requested`` requests of ``per_request`` bytes each."""
    return lambda budget: max(0, min(requested, budget // per_request))


def test_reserve_uses_the_requested_bucket_when_memory_is_plentiful() -> None:
    got = size_graph_slot_reserve(48, 100_000 * MIB, 50 * MIB, _capacity(48, 60 * MIB))
    assert (got.max_batch, got.graph_slots, got.reserve_bytes) == (48, 64, 64 * 50 * MIB)


def test_tight_rank_shrinks_the_bucket_instead_of_starving_to_zero() -> None:
    # 3000 MiB free: reserving bucket_for(64) = 64 slots of 50 MiB leaves nothing for requests.
    # The reserve shrinks to 32 slots (1600 MiB) and 1400 MiB fit 28 requests, whose bucket is 32.
    got = size_graph_slot_reserve(64, 3000 * MIB, 50 * MIB, _capacity(64, 50 * MIB))
    assert (got.max_batch, got.graph_slots) == (28, 32)
    assert got.reserve_bytes + got.max_batch * 50 * MIB <= 3000 * MIB


def test_reserve_shrinks_to_the_bucket_of_the_fitted_batch() -> None:
    # Bucket 64 reserved, 10 requests fit beside it: reserve bucket_for(10) = 16 slots instead,
    # which frees memory: 13 requests fit, and bucket_for(13) == 16 is stable.
    got = size_graph_slot_reserve(64, 2000 * MIB, 10 * MIB, _capacity(64, 136 * MIB))
    assert (got.max_batch, got.graph_slots) == (13, 16)


def test_nothing_fits_reports_zero() -> None:
    got = size_graph_slot_reserve(8, 40 * MIB, 50 * MIB, _capacity(8, 50 * MIB))
    assert (got.max_batch, got.graph_slots, got.reserve_bytes) == (0, 0, 0)


def test_requests_above_the_largest_bucket_are_capped() -> None:
    got = size_graph_slot_reserve(1000, 10**15, 1, _capacity(1000, 1))
    assert (got.max_batch, got.graph_slots) == (256, 256)


@given(
    requested=st.integers(1, 300),
    free_mib=st.integers(0, 20_000),
    slot_mib=st.integers(1, 200),
    request_mib=st.integers(1, 400),
)
def test_reserve_always_covers_the_effective_bucket_and_fits(
    requested: int, free_mib: int, slot_mib: int, request_mib: int
) -> None:
    got = size_graph_slot_reserve(
        requested, free_mib * MIB, slot_mib * MIB, _capacity(requested, request_mib * MIB)
    )
    if got.max_batch == 0:
        # Not even one request fits beside a one-slot reserve.
        assert (free_mib - slot_mib) // request_mib < 1
        return
    assert got.max_batch <= min(requested, 256)
    assert got.graph_slots == bucket_for(got.max_batch)
    assert got.reserve_bytes == got.graph_slots * slot_mib * MIB
    assert got.reserve_bytes + got.max_batch * request_mib * MIB <= free_mib * MIB
