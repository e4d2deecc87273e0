"""What an answered step hands the prefix cache: every chunk's blocks and snapshots, but for a
rejected request's chunk, which ran with stand-in values, ended request or not."""

from __future__ import annotations

from phalanx.protocol.messages import PrefillChunk, PrefillDone, RequestRejected, StateSnapshot
from phalanx.scheduler.apply import Applier
from phalanx.scheduler.planner import StepPlan


class RecordingPlanner:
    """The planner calls an answered step makes about its chunks, recorded; nothing else."""

    def __init__(self) -> None:
        self.answered: list[int] = []
        self.rejected: list[int] = []
        self.requests: dict = {}

    def chunk_answered(self, request, chunk: PrefillChunk) -> None:
        self.answered.append(chunk.request_id)

    def chunk_rejected(self, chunk: PrefillChunk) -> None:
        self.rejected.append(chunk.request_id)


class Request:
    def __init__(self, request_id: int) -> None:
        self.request_id = request_id


def _chunk(request_id: int) -> PrefillChunk:
    return PrefillChunk(
        request_id, b"\x01\x00\x00\x00", 0, b"\x00\x00\x00\x00", False, save=[StateSnapshot(0, 9, 1)]
    )


def test_a_rejected_chunk_joins_no_cache_even_when_its_request_ended_meanwhile() -> None:
    planner = RecordingPlanner()
    applier = Applier(planner, executor=None, eos_token_ids=frozenset())  # type: ignore[arg-type]
    plan = StepPlan([], [(Request(request_id), _chunk(request_id)) for request_id in (1, 2, 3)])
    reply = PrefillDone([], rejected=[RequestRejected(2, "bad"), RequestRejected(3, "bad")])
    finished = applier.apply(plan, reply, ended={3})
    assert planner.answered == [1]
    assert planner.rejected == [2, 3]
    assert [(request.request_id, error.message) for _, request, _, error in finished] == [
        (2, "request 2 rejected by rank 0 during prefill: bad")
    ]
