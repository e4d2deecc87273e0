"""Through real rank processes and sockets at TP 1, 2, 4: the same greedy tokens and logprobs as
the in-process model, DropRequest expectations and slot moves, and worker-side state checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from phalanx.executor.errors import ExecutorPoisoned, StepRejected
from phalanx.executor.launcher import launch_executor
from phalanx.executor.runtime import Executor
from phalanx.protocol.messages import (
    Decode,
    DropRequest,
    Expectation,
    Ping,
    Prefill,
    SlotMove,
    TokenResult,
    Unified,
)
from tests.support.runtime_helpers import (
    chunk,
    rank_exit_codes,
    rank_pids,
    reference_generation,
    row,
    small_config,
)

PROMPTS = {1: [5, 17, 42, 99, 7, 300, 12], 2: [64, 3, 250, 8, 1], 3: [400, 11, 23]}
STEPS = 4


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[int, list[TokenResult]]:
    return {
        request: reference_generation(tiny_model_dir, prompt, STEPS) for request, prompt in PROMPTS.items()
    }


@pytest.fixture(scope="module")
def tp2(tiny_model_dir: Path):
    executor = launch_executor(small_config(tiny_model_dir, 2))
    yield executor
    executor.shutdown()


def _serve_scenario(ex: Executor, base: int) -> dict[int, list[TokenResult]]:
    """Chunked prefill, a unified step, batched decode, compaction and plain drops.

    Request ids are ``base + 1..3``; request index i uses pages_of(i) and, once decoding, a
    scheduler-style dense slot.
    """
    a, b, c = base + 1, base + 2, base + 3
    out: dict[int, list[TokenResult]] = {a: [], b: [], c: []}
    pa, pb, pc = PROMPTS[1], PROMPTS[2], PROMPTS[3]

    def record(results: list[TokenResult]) -> None:
        for result in results:
            out[result.request_id].append(result)

    # Step 1: A's first chunk and B's whole prompt.
    record(ex.call(Prefill([chunk(a, 0, pa[:4], 0, False), chunk(b, 1, pb, 0, True)])).results)
    # Step 2 (unified): A's last chunk, B's first decode row in slot 0.
    done = ex.call(Unified([chunk(a, 0, pa[4:], 4, True)], [row(b, 1, 0, out[b][-1].token, len(pb))]))
    record(done.prefill)
    record(done.decode)
    # Step 3: C's prompt alone. Steps 4-5: everyone decodes (B slot 0, A slot 1, C slot 2).
    record(ex.call(Prefill([chunk(c, 2, pc, 0, True)])).results)
    slots = {b: 0, a: 1, c: 2}
    index = {a: 0, b: 1, c: 2}
    prompt = {a: pa, b: pb, c: pc}

    def decode(requests: list[int]) -> None:
        rows = [
            row(r, index[r], slots[r], out[r][-1].token, len(prompt[r]) + len(out[r]) - 1)
            for r in sorted(requests, key=slots.get)
        ]
        record(ex.call(Decode(rows)).results)

    decode([a, b, c])
    # B retires: the last slot (C, slot 2) moves into its hole.
    ex.call(DropRequest(b, Expectation.MUST_EXIST, SlotMove(c, 2, 0)))
    slots[c] = 0
    ex.call(DropRequest(b, Expectation.MUST_BE_ABSENT))
    decode([a, c])
    decode([a, c])
    ex.call(DropRequest(a, Expectation.MUST_EXIST))  # A held slot 1, the last one: no move
    ex.call(DropRequest(c, Expectation.MUST_EXIST))
    return out


def _assert_matches(
    out: dict[int, list[TokenResult]], references: dict[int, list[TokenResult]], base: int
) -> None:
    for index in PROMPTS:
        got, want = out[base + index], references[index]
        steps = min(len(got), len(want))
        assert steps >= 3
        assert [r.token for r in got[:steps]] == [r.token for r in want[:steps]]
        for g, w in zip(got[:steps], want[:steps], strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert g.top_ids == w.top_ids
            assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_runtime_matches_in_process_model(tp: int, tp2: Executor, tiny_model_dir: Path, references) -> None:
    if tp == 2:
        _assert_matches(_serve_scenario(tp2, 100), references, 100)
        return
    with launch_executor(small_config(tiny_model_dir, tp)) as ex:
        assert ex.world_size == tp
        _assert_matches(_serve_scenario(ex, 0), references, 0)
    assert rank_exit_codes(ex) == [0] * tp  # bounded shutdown: every rank acknowledged and left
    runtime_dir = os.path.dirname(ex.address.removeprefix("ipc://"))
    assert not os.path.exists(runtime_dir)  # the private ipc directory is gone


def test_drop_expectations_of_unknown_request(tp2: Executor) -> None:
    tp2.call(DropRequest(999, Expectation.MUST_BE_ABSENT))
    with pytest.raises(StepRejected, match="moves the dropped request itself"):
        tp2.call(DropRequest(5, Expectation.MUST_EXIST, SlotMove(5, 1, 0)))
    tp2.call(Ping())


def test_structural_errors_are_rejected_without_poison(tp2: Executor) -> None:
    with pytest.raises(StepRejected, match="duplicate request id 7 in one prefill command"):
        tp2.call(Prefill([chunk(7, 0, [1], 0, True), chunk(7, 1, [2], 0, True)]))
    with pytest.raises(StepRejected, match="unified request 8 appears in both prefill and decode"):
        tp2.call(Unified([chunk(8, 0, [1], 0, True)], [row(8, 0, 0, 1, 1)]))
    with pytest.raises(StepRejected, match="slot 4 outside 0..3"):
        tp2.call(Decode([row(9, 0, 4, 1, 1)]))
    tp2.call(Ping())
    assert tp2.poison_reason is None


def test_worker_state_mismatch_poisons_the_executor(tp2: Executor) -> None:
    """Runs last on this executor: a MustExist drop of a request no rank knows poisons it."""
    with pytest.raises(
        ExecutorPoisoned, match=r"drop request expected MustExist, got rank existence \[False, False\]"
    ):
        tp2.call(DropRequest(4242, Expectation.MUST_EXIST))
    with pytest.raises(ExecutorPoisoned, match=r"^executor is poisoned: drop request expected MustExist"):
        tp2.call(Ping())
    assert all(pid is not None for pid in rank_pids(tp2))
