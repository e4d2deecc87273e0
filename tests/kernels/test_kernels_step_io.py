"""The Triton kernels around the model in a decode step against their torch reference, on CPU
under ``TRITON_INTERPRET=1``: the decode KV indices, the host staging load and the greedy pick.

As in ``test_kernels_triton.py`` the checks run in one child process (this file run as a script)
so the interpreter never leaks into other tests; it prints one JSON line per check.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.support.interpreter_checks import assert_within, report, run_interpreted


def check_decode_kv_indices() -> dict[str, float]:
    from phalanx.kernels.kv_cache import decode_kv_indices_ref
    from phalanx.kernels.kv_cache_triton import decode_kv_indices_triton

    positions = torch.tensor([0, 3, 4, 17, 9])  # a page start, a page end, later pages
    table = torch.randint(0, 50, (5, 7), dtype=torch.int32)[:, :6]  # row stride 7, not the width
    slots, lengths = decode_kv_indices_triton(positions, table, 4)
    slots_ref, lengths_ref = decode_kv_indices_ref(positions, table, 4)
    return {
        "slots_differ": float(slots.dtype != torch.int64 or not torch.equal(slots, slots_ref)),
        "lengths_differ": float(lengths.dtype != torch.int32 or not torch.equal(lengths, lengths_ref)),
    }


def check_load_staged() -> dict[str, float]:
    from phalanx.kernels.host_staging_triton import (
        HEADER_ACK,
        HEADER_COLUMNS,
        HEADER_SEQ,
        feed_tokens,
        load_staged_triton,
    )

    def load_staged_ref(
        header: torch.Tensor,
        host_rows: torch.Tensor,
        host_table: torch.Tensor,
        rows: torch.Tensor,
        table: torch.Tensor,
        fed: torch.Tensor,
        step: torch.Tensor,
        bucket: int,
    ) -> None:
        """What ``load_staged_triton`` does, in torch."""
        columns = int(header[HEADER_COLUMNS])
        step[0] = header[HEADER_SEQ]
        rows[:, :bucket].copy_(host_rows[:, :bucket])
        rows[0, :bucket] = feed_tokens(rows[0, :bucket], rows[2, :bucket], fed)
        table[:bucket, :columns].copy_(host_table[: bucket * columns].view(bucket, columns))
        header[HEADER_ACK] = header[HEADER_SEQ]

    top, max_pages, bucket, columns = 8, 6, 5, 3
    header = torch.tensor([7, columns, 6, 0])  # step 7 staged, step 6 acknowledged
    host_rows = torch.randint(0, 1000, (3, top))
    host_rows[2] = torch.randperm(top)  # state slots
    host_rows[0, 1] = host_rows[0, 3] = -1  # FED_TOKEN: rows 1 and 3 feed from their slots
    fed = torch.arange(2000, 2000 + top)
    host_table = torch.randint(0, 50, (top * max_pages,), dtype=torch.int32)
    rows, table = torch.full((3, top), -1), torch.full((top, max_pages), -1, dtype=torch.int32)
    arrivals = torch.zeros(1, dtype=torch.int32)
    ref_header, ref_rows, ref_table = header.clone(), rows.clone(), table.clone()
    step, ref_step = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    load_staged_triton(header, host_rows, host_table, rows, table, arrivals, fed, step, bucket)
    load_staged_ref(ref_header, host_rows, host_table, ref_rows, ref_table, fed, ref_step, bucket)
    fed_expected = fed[host_rows[2, [1, 3]]]
    return {
        "rows_differ": float(not torch.equal(rows, ref_rows)),
        "fed_rows_wrong": float(not torch.equal(rows[0, [1, 3]], fed_expected)),
        "table_differs": float(not torch.equal(table, ref_table)),
        "header_differs": float(not torch.equal(header, ref_header) or int(header[HEADER_ACK]) != 7),
        "untouched_differ": float(not (rows[:, bucket:] == -1).all() or not (table[:, columns:] == -1).all()),
        "counter_left": float(arrivals.item()),
        "seq_and_columns_kept": float(int(header[HEADER_SEQ]) != 7 or int(header[HEADER_COLUMNS]) != columns),
        "step_not_stored": float(int(step) != 7 or int(ref_step) != 7),
    }


def check_greedy_pick() -> dict[str, float]:
    """Rows split over several programs (chunks of 32 of a 150-token vocabulary, the last partial)
    and over one: ties go to the smallest id, also across chunks; a row of -inf answers 0; NaN
    counts as the largest; fed gets each row's token at its slot and nothing else; the landing's
    half of the step's parity gets [seq, tokens...]."""
    from phalanx.kernels.greedy import greedy_pick_ref
    from phalanx.kernels.greedy_triton import _WORKSPACE, greedy_pick_triton

    logits = torch.randn(6, 150)
    logits[1, [40, 7, 129]] = 9.0  # a tie across three chunks: 7 wins
    logits[2, [100, 101]] = 9.0  # a tie inside one chunk
    logits[3] = float("-inf")
    logits[4, 149] = 9.0  # the last, partial chunk
    logits[5, 77] = float("nan")
    slots = torch.tensor([5, 0, 7, 2, 3, 1])
    results = {}
    for chunk, seq in ((32, 12), (256, 7)):  # each lands in its half of the ring, the other untouched
        fed, fed_ref = torch.full((9,), -1), torch.full((9,), -1)
        landing, landing_ref = torch.full((2, 8), -1), torch.full((2, 8), -1)
        step = torch.tensor([seq])
        tokens = greedy_pick_triton(logits, slots, fed, landing, step, chunk=chunk)
        ref = greedy_pick_ref(logits, slots, fed_ref, landing_ref, step)
        results[f"tokens_differ_{chunk}"] = float(not torch.equal(tokens, ref))
        results[f"fed_differs_{chunk}"] = float(not torch.equal(fed, fed_ref))
        landed = torch.equal(landing[seq % 2], torch.cat([step, ref, torch.tensor([-1])]))
        results[f"landing_differs_{chunk}"] = float(not landed or not torch.equal(landing, landing_ref))
    plain_fed = torch.full((9,), -1)
    results["tokens_differ_unlanded"] = float(
        not torch.equal(greedy_pick_triton(logits, slots, plain_fed), ref)
    )
    results["counters_left"] = float(_WORKSPACE.current[logits.device][2].count_nonzero())
    return results


CHECKS: dict[str, Callable[[], dict[str, float]]] = {
    name.removeprefix("check_"): fn for name, fn in list(globals().items()) if name.startswith("check_")
}
# Every check here compares integers or flags: nothing may differ.
TOLERANCE = {
    "slots_differ": 0.0,
    "lengths_differ": 0.0,
    "rows_differ": 0.0,
    "table_differs": 0.0,
    "header_differs": 0.0,
    "untouched_differ": 0.0,
    "counter_left": 0.0,
    "seq_and_columns_kept": 0.0,
    "tokens_differ_32": 0.0,
    "tokens_differ_256": 0.0,
    "tokens_differ_unlanded": 0.0,
    "fed_differs_32": 0.0,
    "fed_differs_256": 0.0,
    "counters_left": 0.0,
    "step_not_stored": 0.0,
    "landing_differs_32": 0.0,
    "landing_differs_256": 0.0,
}
DEFAULT_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=240)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_triton_kernel_matches_reference(
    name: str, interpreted_results: dict[str, dict[str, object]]
) -> None:
    assert_within(interpreted_results, name, TOLERANCE, DEFAULT_TOLERANCE)


if __name__ == "__main__":
    report(CHECKS)
