"""The effective capacity the coordinator hands every rank in Go: each field the minimum over ranks."""

from __future__ import annotations

from phalanx.executor.gate import effective_capacity
from phalanx.protocol.messages import Capacity, Ready


def test_every_field_is_the_minimum_over_the_ranks_prefix_snapshots_too() -> None:
    ready = {
        rank: Ready(capacity, "cpu", 100 + rank, "host", nonce=b"n")
        for rank, capacity in enumerate([Capacity(64, 16, 8, 512, 40), Capacity(32, 16, 16, 256, 12)])
    }
    assert effective_capacity(ready) == Capacity(32, 16, 8, 256, 12)
    ready[2] = Ready(Capacity(64, 16, 8, 512, 0), "cpu", 102, "host", nonce=b"n")  # its cache is off
    assert effective_capacity(ready).snapshot_slots == 0
