"""The pre-capture sweep through real rank processes (TP 2, CPU: eager static buffers).

The protocol trace shows the choreography as the coordinator saw it: the phases in order, each one
acknowledged by every rank before the next is sent. Serving afterwards runs the bucketed static
buffers with padding rows and gives the in-process model's greedy tokens. A rank that fails or
goes silent during the sweep stops the sweep and every rank.
"""

from __future__ import annotations

import multiprocessing
import re
from pathlib import Path

import pytest

from phalanx.executor.errors import StartupError
from phalanx.executor.launcher import launch_executor
from phalanx.executor.precapture import phase_name
from phalanx.protocol.messages import (
    Decode,
    DropRequest,
    Expectation,
    Precapture,
    Prefill,
    SlotMove,
    TokenResult,
)
from phalanx.protocol.trace import read_trace
from phalanx.worker import faults
from tests.support.runtime_helpers import chunk, reference_generation, row, small_config

PROMPTS = {0: [5, 17, 42, 99, 7, 300, 12], 1: [64, 3, 250, 8, 1], 2: [400, 11, 23]}
MAX_SLOTS = 3  # buckets 1, 2, 4: a batch of 3 pads to 4
SWEEP = [
    "Warmup",
    "Capture(4)",
    "Launch(4)",
    "Capture(2)",
    "Launch(2)",
    "Capture(1)",
    "Launch(1)",
    "Finalize",
]


def _graph_config(model_dir: Path, **overrides: object):
    return small_config(model_dir, 2, cuda_graph=True, max_slots=MAX_SLOTS, **overrides)


def _no_rank_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("phalanx-rank")]


def test_sweep_runs_in_lockstep_then_serving_matches_the_reference(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trace_path = tmp_path / "graphs.trace"
    ex = launch_executor(_graph_config(tiny_model_dir, record=str(trace_path)))
    try:
        tokens = _serve(ex)
    finally:
        ex.shutdown()
    assert _no_rank_left()

    trace = read_trace(trace_path)
    sent = [e for e in trace.sends() if isinstance(e.message.body, Precapture)]
    assert [phase_name(e.message.body.phase) for e in sent] == SWEEP
    for this, following in zip(sent, [*sent[1:], None], strict=True):
        acks = [e for e in trace.replies() if e.seq == this.seq]
        assert sorted(e.rank for e in acks) == [0, 1] and {e.op for e in acks} == {"ack"}
        if following is not None:  # a barrier: every rank answered before the next phase left
            assert max(e.index for e in acks) < following.index

    for index, prompt in PROMPTS.items():
        want = [r.token for r in reference_generation(tiny_model_dir, prompt, len(tokens[index]))]
        assert tokens[index] == want, f"request {index}"


def _serve(ex) -> dict[int, list[int]]:
    """Three requests: a padded batch of 3 (bucket 4), retirements with slot moves, then 2 and 1."""
    out: dict[int, list[int]] = {i: [] for i in PROMPTS}
    slots = {0: 0, 1: 1, 2: 2}

    def record(results: list[TokenResult]) -> None:
        for result in results:
            out[result.request_id - 1].append(result.token)

    record(ex.call(Prefill([chunk(i + 1, i, p, 0, True) for i, p in PROMPTS.items()])).results)

    def decode(requests: list[int]) -> None:
        rows = [
            row(i + 1, i, slots[i], out[i][-1], len(PROMPTS[i]) + len(out[i]) - 1)
            for i in sorted(requests, key=slots.get)
        ]
        record(ex.call(Decode(rows)).results)

    decode([0, 1, 2])
    decode([0, 1, 2])
    ex.call(
        DropRequest(2, Expectation.MUST_EXIST, SlotMove(3, 2, 1))
    )  # request 1 retires; the last slot moves in
    slots[2] = 1
    decode([0, 2])
    ex.call(DropRequest(1, Expectation.MUST_EXIST, SlotMove(3, 1, 0)))
    slots[2] = 0
    decode([2])
    return out


def test_a_failing_rank_stops_the_sweep_and_every_rank(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(faults.ENV, "1:precapture#3:raise")  # rank 1 fails at Launch(4)
    with pytest.raises(StartupError) as caught:
        launch_executor(_graph_config(tiny_model_dir))
    message = str(caught.value)
    assert message.startswith(
        "decode graph pre-capture failed: executor is poisoned: rank 1 failed during precapture"
    )
    assert (
        "pre-capture Launch(4) failed on rank 1: InjectedFault: injected fault at precapture #3 on rank 1"
        in message
    )
    assert caught.value.phase == "startup:precapture"
    assert _no_rank_left()


def test_a_silent_rank_stops_the_sweep_and_every_rank(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(faults.ENV, "0:precapture#2:hang")  # rank 0 never answers Capture(4)
    with pytest.raises(StartupError) as caught:
        launch_executor(_graph_config(tiny_model_dir, step_timeout=3.0))
    assert re.search(r"precapture did not complete within 3 s: no reply from ranks \[0\]", str(caught.value))
    assert _no_rank_left()
