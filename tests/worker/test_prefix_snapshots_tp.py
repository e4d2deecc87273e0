"""Prefix snapshots through real rank processes at TP 2 (gloo): each rank reports its snapshot
slots, saves its shard of the linear-attention state mid-chunk and restores it for another prompt
over the shared KV pages; greedy tokens and logprobs equal an uninterrupted in-process prefill.
With the prefix cache off the ranks report no snapshot slots."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.executor.errors import StepRejected
from phalanx.executor.launcher import launch_executor
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import Decode, DecodeRow, Prefill, PrefillChunk, StateSnapshot, TokenResult
from tests.support.runtime_helpers import LOGPROBS, reference_generation, small_config

SHARED = [5, 17, 42, 99, 7, 300, 12, 8, 61, 3, 250]  # the first 8 tokens are the shared prefix
OTHER = SHARED[:8] + [400, 11, 23]
STEPS = 3


def prefill(request_id: int, tokens: list[int], start: int, pages: list[int], **snapshots) -> Prefill:
    return Prefill(
        [PrefillChunk(request_id, pack_ids(tokens), start, pack_ids(pages), True, LOGPROBS, **snapshots)]
    )


def generate(
    ex, request_id: int, slot: int, first: TokenResult, prompt_length: int, pages: list[int]
) -> list[TokenResult]:
    results = [first]
    for step in range(STEPS - 1):
        row = DecodeRow(request_id, slot, results[-1].token, prompt_length + step, pack_ids(pages), LOGPROBS)
        results += ex.call(Decode([row])).results
    return results


def assert_matches(got: list[TokenResult], want: list[TokenResult]) -> None:
    assert [r.token for r in got] == [r.token for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert g.top_ids == w.top_ids
        assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-4)


def test_a_restore_at_tp2_matches_an_uninterrupted_prefill(tiny_model_dir: Path) -> None:
    wants = [reference_generation(tiny_model_dir, prompt, STEPS) for prompt in (SHARED, OTHER)]
    with launch_executor(small_config(tiny_model_dir, 2, prefix_snapshots=3)) as ex:
        assert ex.capacity.snapshot_slots == 3
        shared_pages, other_pages = [0, 1, 2, 3], [0, 1, 6, 7]
        (first,) = ex.call(prefill(1, SHARED, 0, shared_pages, save=[StateSnapshot(2, 77, 8)])).results
        assert_matches(generate(ex, 1, 0, first, len(SHARED), shared_pages), wants[0])
        restore = StateSnapshot(2, 77, 8)
        (first,) = ex.call(prefill(2, OTHER[8:], 8, other_pages, restore=restore)).results
        assert_matches(generate(ex, 2, 1, first, len(OTHER), other_pages), wants[1])


def test_ranks_without_a_prefix_cache_report_no_snapshot_slots(tiny_model_dir: Path) -> None:
    """A save is then refused before any rank sees it, and the replica serves on."""
    with launch_executor(small_config(tiny_model_dir, 1, prefix_cache=False)) as ex:
        assert ex.capacity.snapshot_slots == 0
        saving = prefill(1, SHARED, 0, [0, 1, 2, 3], save=[StateSnapshot(0, 77, 8)])
        with pytest.raises(
            StepRejected, match="^prefill chunk for request 1 names snapshot slot 0; the ranks keep 0$"
        ):
            ex.call(saving)
        (first,) = ex.call(prefill(1, SHARED, 0, [0, 1, 2, 3])).results
        assert_matches([first], reference_generation(tiny_model_dir, SHARED, 1))
