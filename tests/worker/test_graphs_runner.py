"""The decode graph runner in eager static-buffer mode (CPU): buckets, padding rows, slot mapping,
the sweep's phase order on one rank, and equality with plain decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from phalanx.executor.precapture import sweep_phases
from phalanx.models.qwen35 import Qwen35Model
from phalanx.models.qwen35.batch import DecodeBatch, PrefillBatch
from phalanx.protocol.messages import Capture, Finalize, Launch, Warmup
from phalanx.worker import graph_gate, graph_inputs
from phalanx.worker.buckets import state_slot_layout
from phalanx.worker.graph_gate import graph_blocker
from phalanx.worker.graph_geometry import GraphError, GraphGeometry, padding_slots
from phalanx.worker.graphs import DecodeGraphRunner

PAGE_SIZE = 8
PAGES_PER_REQUEST = 4
KV_PAGES = 48  # usable pages; page KV_PAGES is the padding page
MAX_BATCH = 5  # top bucket 8
LAYOUT = state_slot_layout(MAX_BATCH, cuda_graph=True)  # decode 0..4, staging 5..9, spare 10..12
CPU = torch.device("cpu")


def _load(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Qwen35Model:
    model = Qwen35Model.load(model_dir, rank=0, world_size=1, device=device, dtype=dtype)
    model.allocate_cache(KV_PAGES + 1, PAGE_SIZE, LAYOUT.total)
    return model


class Pair:
    """Two copies of the tiny model fed the same requests: one decodes plainly, one via the runner
    (after the full pre-capture sweep). Each step checks the runner's logits against plain decode."""

    def __init__(
        self,
        model_dir: Path,
        num_requests: int,
        *,
        device: torch.device = CPU,
        dtype: torch.dtype = torch.float32,
        relative_error: float | None = None,
        pages_per_request: int = PAGES_PER_REQUEST,
    ) -> None:
        self.device = device
        self.relative_error = relative_error
        self.pages_per_request = pages_per_request
        self.plain = _load(model_dir, device, dtype)
        self.graphed = _load(model_dir, device, dtype)
        geometry = GraphGeometry(
            max_batch=MAX_BATCH,
            max_pages=pages_per_request,
            padding_page=KV_PAGES,
            spare_slot_base=LAYOUT.spare_base,
            hidden_size=self.graphed.config.hidden_size,
            dtype=dtype,
        )
        self.runner = DecodeGraphRunner(self.graphed, geometry, device)
        for phase in sweep_phases(self.runner.buckets):
            self.runner.run_phase(phase)
        generator = torch.Generator().manual_seed(7)
        self.slot_of: dict[int, int] = {}
        self.position: dict[int, int] = {}
        self.token: dict[int, int] = {}
        chunks = []
        for request in range(num_requests):
            length = 3 + 2 * request
            prompt = torch.randint(0, 384, (length,), generator=generator).tolist()
            chunks.append((prompt, 0, request, self.pages(request)[: -(-length // PAGE_SIZE)]))
            self.slot_of[request] = request
            self.position[request] = length
        for model in (self.plain, self.graphed):
            logits = model.prefill(PrefillBatch.build(chunks, device))
        for request, row in enumerate(logits.argmax(-1).tolist()):
            self.token[request] = row

    def pages(self, request: int) -> list[int]:
        return list(range(request * self.pages_per_request, (request + 1) * self.pages_per_request))

    def rows(self, requests: list[int]) -> list[tuple[int, int, int, list[int]]]:
        return [
            (
                self.token[r],
                self.position[r],
                self.slot_of[r],
                self.pages(r)[: self.position[r] // PAGE_SIZE + 1],
            )
            for r in requests
        ]

    def step(self, requests: list[int], occupied: list[int] | None = None) -> None:
        rows = self.rows(requests)
        expected = self.plain.decode(DecodeBatch.build(rows, self.device, max_pages=self.pages_per_request))
        got = self.runner.decode(DecodeBatch.build(rows), occupied_slots=occupied or [])
        assert got.shape == expected.shape
        if self.relative_error is None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:  # bf16: the error of the whole step's logits, relative to their norm
            error = float((got.float() - expected.float()).norm() / expected.float().norm())
            assert error <= self.relative_error, f"logits differ by {error:.3g} (relative)"
        for r, token in zip(requests, expected.argmax(-1).tolist(), strict=True):
            self.token[r] = token
            self.position[r] += 1

    def move(self, request: int, to_slot: int) -> None:
        for model in (self.plain, self.graphed):
            model.copy_state(self.slot_of[request], to_slot)
        self.slot_of[request] = to_slot


def test_static_buffer_decode_equals_plain_decode_across_bucket_straddles(tiny_model_dir: Path) -> None:
    pair = Pair(tiny_model_dir, 5)
    live = [0, 1, 2, 3, 4]
    # Batches of 1, 3 and 5 rows run buckets 1, 4 and 8; the requests that sit a step out keep
    # their slots, so the padding rows must take spare slots instead.
    pair.step([0], occupied=live)
    pair.step([0, 1, 2], occupied=live)
    pair.step([0, 1, 2, 3, 4], occupied=live)
    pair.step([0, 1, 2], occupied=live)
    pair.step([0, 1, 2, 3, 4], occupied=live)
    assert pair.runner.replays == 0  # CPU: no graphs, every step eager


def test_static_buffer_decode_after_slot_compaction(tiny_model_dir: Path) -> None:
    pair = Pair(tiny_model_dir, 5)
    pair.step([0, 1, 2, 3, 4])
    # Request 1 retires from slot 1; the last slot (request 4) moves into the hole.
    pair.move(4, 1)
    pair.step([0, 4, 2, 3])  # dense slots 0..3, bucket 4
    pair.step([0, 4, 2, 3])
    # Request 3 retires from the last slot: 3 rows, bucket 4, one padding row in freed slot 3.
    pair.step([0, 4, 2])
    pair.step([0, 4, 2])


def test_sweep_phases_must_arrive_in_order(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir, CPU, torch.float32)
    geometry = GraphGeometry(
        max_batch=3,
        max_pages=2,
        padding_page=KV_PAGES,
        spare_slot_base=6,
        hidden_size=64,
        dtype=torch.float32,
    )
    runner = DecodeGraphRunner(model, geometry, CPU)
    assert runner.buckets == (1, 2, 4) and not runner.uses_cuda_graphs
    with pytest.raises(GraphError, match="pre-capture capture of bucket 4 before Warmup"):
        runner.run_phase(Capture(4))
    runner.run_phase(Warmup())
    with pytest.raises(GraphError, match="pre-capture launch of bucket 4 before its capture"):
        runner.run_phase(Launch(4))
    with pytest.raises(
        GraphError,
        match=r"pre-capture capture of bucket 8, which is not one of this rank's buckets \[1, 2, 4\]",
    ):
        runner.run_phase(Capture(8))
    runner.run_phase(Capture(4))
    with pytest.raises(GraphError, match="pre-capture capture of bucket 4, which is already captured"):
        runner.run_phase(Capture(4))
    runner.run_phase(Launch(4))
    runner.run_phase(Capture(1))
    runner.run_phase(Launch(1))
    batch = DecodeBatch.build([(1, 0, 0, [0])])
    with pytest.raises(GraphError, match="decode before the graph pre-capture sweep finalized"):
        runner.decode(batch)
    with pytest.raises(GraphError, match="decode graph pre-capture left bucket 2 uncaptured"):
        runner.run_phase(Finalize())
    runner.run_phase(Capture(2))
    runner.run_phase(Launch(2))
    runner.run_phase(Finalize())
    with pytest.raises(GraphError, match=r"pre-capture phase Warmup after Finalize"):
        runner.run_phase(Warmup())
    with pytest.raises(GraphError, match="decode batch of 5 rows exceeds the largest captured bucket 4"):
        runner.decode(DecodeBatch.build([(1, 0, s, [0]) for s in range(5)]))
    with pytest.raises(
        GraphError, match="decode row page table has 3 pages, more than the graph page-table width 2"
    ):
        runner.decode(DecodeBatch.build([(1, 0, 0, [0, 1, 2])]))
    assert runner.decode(batch).shape == (1, 512)
    with pytest.raises(GraphError, match="replay_last needs a CUDA-graph decode to replay; none has run"):
        runner.replay_last(1)  # eager static-buffer mode has no graph to replay
    runner.release()
    assert not runner.finalized


def test_gate_keeps_decode_eager_and_says_so_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert graph_blocker(object(), CPU) == "device cpu has no CUDA graphs"
    monkeypatch.setattr(graph_gate, "_GATE_LOGGED", set())
    model = _load(tiny_model_dir, CPU, torch.float32)
    geometry = GraphGeometry(
        max_batch=2,
        max_pages=2,
        padding_page=KV_PAGES,
        spare_slot_base=4,
        hidden_size=64,
        dtype=torch.float32,
    )
    with capture_logs() as logs:
        runners = [DecodeGraphRunner(model, geometry, CPU) for _ in range(3)]
    assert not any(runner.uses_cuda_graphs for runner in runners)
    gate_lines = [
        line for line in logs if line["event"].startswith("CUDA graph requested but decode stays eager")
    ]
    assert len(gate_lines) == 1 and gate_lines[0]["reason"] == "device cpu has no CUDA graphs"


def test_padding_slots_pick_free_decode_slots_then_spare_slots() -> None:
    candidates = [0, 1, 2, 3, 4, 10, 11, 12]  # max_batch 5: decode 0..4, spare 10..12
    assert padding_slots([0, 1, 2], 4, candidates, occupied=[0, 1, 2]) == [3]
    assert padding_slots([0, 1, 2, 3, 4], 8, candidates, occupied=range(5)) == [10, 11, 12]
    assert padding_slots([0, 1, 2], 4, candidates, occupied=[0, 1, 2, 3]) == [4]
    assert padding_slots([1, 0], 4, candidates, occupied=[0, 1, 4]) == [2, 3]
    assert padding_slots([2, 0], 2, candidates, occupied=[]) == []
    assert padding_slots([3], 2, candidates, occupied=[0]) == [1]
    with pytest.raises(
        GraphError, match="decode bucket 8 needs 5 padding state slots but only 4 of 8 are free"
    ):
        padding_slots([0, 1, 2], 8, candidates, occupied=[0, 1, 2, 3])


def test_state_slot_layout_completes_the_decode_region_to_the_top_bucket() -> None:
    layout = state_slot_layout(5, cuda_graph=True)  # 3 spare slots, then the prefill padding slot
    assert (layout.spare_base, layout.prefill_padding, layout.total) == (10, 13, 14)
    eager = state_slot_layout(5, cuda_graph=False)
    assert (eager.total, eager.prefill_padding) == (10, None)
    assert state_slot_layout(8, cuda_graph=True).total == 17
    with_snapshots = state_slot_layout(5, cuda_graph=True, snapshot_slots=7)  # after the padding slot
    assert (with_snapshots.snapshot_base, with_snapshots.snapshot_slots, with_snapshots.total) == (14, 7, 21)


def test_staging_writes_rows_and_page_table_and_pads_the_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a step stages into the static buffers (through numpy views of the host buffers): the
    rows' tokens, positions and slots, zeros and free slots for the padding rows, the rows' page ids
    and the padding page below them. The page-table views are rebuilt after the cache is full."""
    monkeypatch.setattr(graph_inputs, "TABLE_VIEWS_KEPT", 2)
    geometry = GraphGeometry(
        max_batch=MAX_BATCH, max_pages=6, padding_page=KV_PAGES, spare_slot_base=LAYOUT.spare_base,
        hidden_size=8, dtype=torch.float32,
    )  # fmt: skip
    runner = DecodeGraphRunner(object(), geometry, CPU)
    for width in (1, 2, 3, 2):  # four widths through a cache of two
        table = torch.arange(3 * width, dtype=torch.int32).view(3, width) + 7
        batch = DecodeBatch(
            tokens=torch.tensor([11, 12, 13]),
            positions=torch.tensor([5, 6, 7]),
            state_slots=torch.tensor([2, 0, 1]),
            page_table=table,
        )
        assert runner._stage_rows(batch, 4, occupied=()) == width
        inputs = runner.inputs
        assert inputs.tokens[:4].tolist() == [11, 12, 13, 0]
        assert inputs.positions[:4].tolist() == [5, 6, 7, 0]
        assert inputs.slots[:3].tolist() == [2, 0, 1] and inputs.slots[3].item() not in (0, 1, 2)
        assert torch.equal(inputs.page_table[:3, :width], table)
        assert inputs.page_table[3, :width].tolist() == [KV_PAGES] * width
        assert len(inputs._table_views) <= 2


def test_a_built_batch_stages_from_the_arrays_its_tensors_view() -> None:
    """``DecodeBatch.build`` keeps the numpy arrays behind its host tensors, so staging converts
    nothing; a batch made from tensors directly stages the same rows through a conversion."""
    rows = [(11, 5, 2, [7, 8]), (12, 6, 0, [9])]
    built = DecodeBatch.build(rows)
    host_rows, table = built.host_arrays()
    assert host_rows.tolist() == [[11, 12], [5, 6], [2, 0]] and table.tolist() == [[7, 8], [9, 9]]
    built.tokens[0] = 13  # one memory: a change through the tensor is what staging sees
    assert built.host_arrays()[0][0, 0] == 13
    plain = DecodeBatch(built.tokens, built.positions, built.state_slots, built.page_table)
    assert plain.host_arrays()[0].tolist() == built.host_arrays()[0].tolist()
    assert DecodeBatch.build(rows, "meta")._host is None  # a device batch holds copies, not views
