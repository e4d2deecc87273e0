"""The decode graph runner: one CUDA graph per batch bucket, replayed from static input buffers.

Decode rows are staged into static buffers (tokens, positions, state slots, page table) sized for
the largest bucket (``worker/graph_inputs.py``); a batch of ``n`` rows runs the graph of
``bucket_for(n)``, whose extra rows are padding: token 0 at position 0, every page the padding KV
page (page id ``kv_pages``), and a free state slot each, so their KV writes and state updates land
where nobody reads. Their logits are discarded. Recurrent and conv state live at fixed addresses in
the model's state pool and are indexed by slot, so a graph never needs re-capturing when requests
move between slots. Each step also picks every row's greedy token (argmax) and writes it to
``inputs.fed_tokens`` at the row's slot, inside the graph, in one kernel
(``kernels/greedy_triton.py``): a pipelined next step feeds from there, and rank 0 draws nothing
more for greedy rows, whose sampling outside the graph would lengthen each step
(docs/benchmarks/kernel-choices-h200.md). Each step's rows and page table are written to pinned
host buffers, which the graph's first kernel reads, and the greedy tokens come back the same way,
landed in pinned memory by that last kernel (``worker/graph_inputs.py``): no copy call either way.

Graphs are made only by the pre-capture sweep, in lockstep across ranks, one phase per command:
``Warmup`` (one eager all-reduce per bucket size, and one eager step per bucket so every kernel
is compiled and tuned before capture), ``Capture(b)`` (record and instantiate, no launch),
``Launch(b)`` (replay and synchronise, so captured collectives pair up across ranks), and
``Finalize`` (every bucket captured). Serving is replay-only: a capture while serving would
desynchronise recorded collectives across ranks.

Where graphs cannot be used (on CPU, or where the model's decode kernels cannot be captured) the
runner runs the same static buffers, padding rows and sweep eagerly, and logs it once
(``worker/graph_gate.py``). Prefill graphs: ``worker/prefill_graphs.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator

import structlog
import torch
import torch.distributed as dist

from phalanx.kernels import ops
from phalanx.kernels.parallel_compile import parallel_compile
from phalanx.models.qwen35 import DecodeBatch
from phalanx.protocol.buckets import bucket_for, buckets_up_to
from phalanx.protocol.messages import (
    Ack,
    Capacity,
    Capture,
    Finalize,
    Launch,
    Precapture,
    PrecapturePhase,
    Warmup,
)
from phalanx.worker.buckets import state_slot_layout
from phalanx.worker.cores import ranks_on_this_host
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.faults import fault_point
from phalanx.worker.graph_gate import graph_blocker, log_gate_once
from phalanx.worker.graph_geometry import GraphError, GraphGeometry, padding_slots
from phalanx.worker.graph_inputs import DecodeInputs, LandedTokens

log = structlog.get_logger("phalanx.graphs")


class DecodeGraphRunner:
    """Bucketed static-buffer decode for one rank, with CUDA graphs where they can be used."""

    def __init__(
        self, model: object, geometry: GraphGeometry, device: torch.device, *, rank: int = 0
    ) -> None:
        if geometry.max_pages < 1:
            raise ValueError(f"graph page-table width {geometry.max_pages} must be at least 1")
        self.model = model
        self.geometry = geometry
        self.device = device
        self.rank = rank
        self.buckets = buckets_up_to(geometry.max_batch)
        top = self.buckets[-1]
        self._candidates = geometry.padding_candidates()
        blocker = graph_blocker(model, device)
        self.uses_cuda_graphs = blocker is None
        if blocker is not None:
            log_gate_once(blocker, rank)

        # With graphs, each graph's first kernel loads the step's rows from pinned memory itself.
        self.inputs = DecodeInputs(
            top,
            geometry.max_pages,
            geometry.padding_page,
            device,
            in_graph=self.uses_cuda_graphs,
            state_slots=max(self._candidates) + 1,
        )

        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._greedy: dict[int, torch.Tensor] = {}  # each graph's argmax tokens [bucket]
        self._last_greedy: torch.Tensor | None = None  # the last decode's, [rows]
        self._last_landed: LandedTokens | None = None  # where the last replay's land on the host
        self._pool: tuple[int, int] | None = None
        self._capture_stream = torch.cuda.Stream(self.device) if self.uses_cuda_graphs else None
        self._warmed = False
        self._captured: set[int] = set()
        self._launched: set[int] = set()
        self.finalized = False
        self.replays = 0
        self._last_rows = 0  # rows of the last decode replayed from a graph (see ``replay_last``)

    # ------------------------------------------------------------------ the pre-capture sweep

    def run_phase(self, phase: PrecapturePhase) -> None:
        """Carry out one phase of the pre-capture sweep (one Precapture command)."""
        if self.finalized:
            raise GraphError(f"pre-capture phase {_phase_name(phase)} after Finalize; serving is replay-only")
        if isinstance(phase, Warmup):
            self._warmup()
        elif isinstance(phase, Capture):
            self._capture(self._known_bucket(phase.bucket, "capture"))
        elif isinstance(phase, Launch):
            self._launch(self._known_bucket(phase.bucket, "launch"))
        elif isinstance(phase, Finalize):
            self._finalize()
        else:
            raise GraphError(f"unknown pre-capture phase {phase!r}")

    def _known_bucket(self, bucket: int, what: str) -> int:
        if bucket not in self.buckets:
            raise GraphError(
                f"pre-capture {what} of bucket {bucket}, which is not one of this rank's buckets {list(self.buckets)}"
            )
        return bucket

    def _warmup(self) -> None:
        started = time.perf_counter()
        # The warm-up compiles and tunes every kernel of every bucket: on an empty Triton cache
        # that is most of the sweep, so each new tuning key's configs compile side by side.
        with parallel_compile(ranks_on_this_host(self.geometry.world_size)):
            for bucket in self.buckets:
                self._stage_padding(bucket)
                with self._on_capture_stream():
                    if self.geometry.world_size > 1:
                        probe = torch.zeros(
                            bucket, self.geometry.hidden_size, dtype=self.geometry.dtype, device=self.device
                        )
                        dist.all_reduce(probe)
                    self._eager(bucket)
            self._synchronize()
        self._warmed = True
        log.info(
            "decode graph warm-up done",
            rank=self.rank,
            buckets=list(self.buckets),
            seconds=round(time.perf_counter() - started, 3),
        )

    def _capture(self, bucket: int) -> None:
        if not self._warmed:
            raise GraphError(f"pre-capture capture of bucket {bucket} before Warmup")
        if bucket in self._captured:
            raise GraphError(f"pre-capture capture of bucket {bucket}, which is already captured")
        started = time.perf_counter()
        if self.uses_cuda_graphs:
            # What eager runs left cached would otherwise show up as memory the capture freed.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        before = _memory_in_use(self.device)
        if self.uses_cuda_graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            batch = self.inputs.batch(bucket, pages=self.geometry.max_pages)
            # torch.cuda.graph records and instantiates; it does not launch (Launch does).
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"
            ):
                self.inputs.load(bucket)  # the graph's first node: the staged rows onto the GPU
                output = self.model.decode(batch)
                greedy = self._pick_greedy(output, batch.state_slots)
            self._graphs[bucket] = graph
            self._outputs[bucket] = output
            self._greedy[bucket] = greedy
            self._synchronize()
        self._captured.add(bucket)
        log.info(
            "decode graph captured",
            rank=self.rank,
            bucket=bucket,
            cuda_graph=self.uses_cuda_graphs,
            seconds=round(time.perf_counter() - started, 3),
            memory_mib=round((_memory_in_use(self.device) - before) / 2**20, 1),
        )

    def _launch(self, bucket: int) -> None:
        if bucket not in self._captured:
            raise GraphError(f"pre-capture launch of bucket {bucket} before its capture")
        started = time.perf_counter()
        self._stage_padding(bucket)
        if self.uses_cuda_graphs:
            self._graphs[bucket].replay()
        else:
            self._eager(bucket)
        self._synchronize()
        self._launched.add(bucket)
        log.info(
            "decode graph launched",
            rank=self.rank,
            bucket=bucket,
            seconds=round(time.perf_counter() - started, 4),
        )

    def _finalize(self) -> None:
        for bucket in self.buckets:
            if bucket not in self._captured or bucket not in self._launched:
                raise GraphError(f"decode graph pre-capture left bucket {bucket} uncaptured")
        self.finalized = True
        log.info(
            "decode graph pre-capture finalized",
            rank=self.rank,
            buckets=list(self.buckets),
            cuda_graph=self.uses_cuda_graphs,
        )

    # ------------------------------------------------------------------ serving

    def decode(self, batch: DecodeBatch, occupied_slots: Collection[int] = ()) -> torch.Tensor:
        """Logits ``[n, vocab]`` for the batch's ``n`` rows, from the bucket's graph (replay only).

        ``batch`` holds host tensors; a row whose token is ``FED_TOKEN`` takes its token from
        ``inputs.fed_tokens`` at its slot. ``occupied_slots`` are the state slots of live requests
        outside this batch; padding rows never touch them. In CUDA-graph mode the result is a
        view of the graph's static output, valid until the next decode.
        """
        if not self.finalized:
            raise GraphError("decode before the graph pre-capture sweep finalized; serving is replay-only")
        n = batch.host_arrays()[0].shape[1]  # numpy: cheaper than a tensor's shape on this path
        if n > self.buckets[-1]:
            raise GraphError(
                f"decode batch of {n} rows exceeds the largest captured bucket {self.buckets[-1]}"
            )
        bucket = bucket_for(n)
        pages = self._stage_rows(batch, bucket, occupied_slots)
        if self.uses_cuda_graphs:
            self._graphs[bucket].replay()
            self.replays += 1
            self._last_rows = n
            self._last_greedy = self._greedy[bucket][:n]
            self._last_landed = self.inputs.landed(n)
            return self._outputs[bucket][:n]
        logits = self._eager(bucket, pages=pages)[:n]
        self._last_greedy = self._last_greedy[:n]
        return logits

    def greedy_tokens(self) -> torch.Tensor:
        """The last decode's greedy token of each row [n], on the device (also in ``fed_tokens``)."""
        if self._last_greedy is None:
            raise GraphError("greedy_tokens before any decode")
        return self._last_greedy

    def landed_tokens(self) -> LandedTokens | None:
        """Where the last graph replay's greedy tokens land on the host (None without graphs)."""
        return self._last_landed

    def replay_last(self, times: int) -> torch.Tensor:
        """Replays the graph of the last decode ``times`` more times, back to back, on the rows it
        staged: no host work between replays, so their span is the GPU's own time for a step,
        which ``bench decode`` sets beside the served step (staging, then replay). A timing aid,
        not a serving path: each replay writes the rows' KV and steps their recurrent state again,
        as another decode of the same rows would. Returns those rows' logits."""
        if not self.uses_cuda_graphs or not self._last_rows:
            raise GraphError("replay_last needs a CUDA-graph decode to replay; none has run")
        if times < 1:
            raise GraphError(f"replay_last of {times} replays; give at least 1")
        bucket = bucket_for(self._last_rows)
        graph = self._graphs[bucket]
        for _ in range(times):
            graph.replay()
        self.replays += times
        return self._outputs[bucket][: self._last_rows]

    def release(self) -> None:
        """Drop every graph (before the process group goes: graphs hold its collectives)."""
        if self._graphs:
            self._synchronize()
        self._graphs.clear()
        self._outputs.clear()
        self._greedy.clear()
        self._last_greedy = None
        self._last_landed = None
        self._pool = None
        self._captured.clear()
        self._launched.clear()
        self._last_rows = 0
        self.finalized = False

    # ------------------------------------------------------------------ static buffers

    def _stage_rows(self, batch: DecodeBatch, bucket: int, occupied: Collection[int]) -> int:
        """Stages the batch's rows and padding rows for ``bucket``; returns the page-table width."""
        rows, table = batch.host_arrays()
        width = table.shape[1]
        if width > self.geometry.max_pages:
            raise GraphError(
                f"decode row page table has {width} pages, more than the graph page-table width "
                f"{self.geometry.max_pages}"
            )
        n = rows.shape[1]
        pad = padding_slots(rows[2].tolist(), bucket, self._candidates, occupied) if n < bucket else []
        return self.inputs.stage(rows, pad, table, bucket)

    def _stage_padding(self, bucket: int) -> None:
        """Every row padding: what the sweep captures and launches (all slots are free then)."""
        self.inputs.stage_padding(bucket, self._candidates[:bucket])

    def _eager(self, bucket: int, pages: int = 1) -> torch.Tensor:
        # Eager runs need not read the whole page-table width; graphs are captured at full width.
        width = self.geometry.max_pages if self.uses_cuda_graphs else pages
        self.inputs.load(bucket)
        batch = self.inputs.batch(bucket, pages=width)
        logits = self.model.decode(batch)
        self._last_greedy = self._pick_greedy(logits, batch.state_slots)
        return logits

    def _pick_greedy(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # The first maximal index: the smallest id among ties, as sampling picks. In graph mode the
        # tokens also land in the inputs' pinned ring (``landed_tokens``).
        inputs = self.inputs
        return ops.greedy_pick(logits, slots, inputs.fed_tokens, inputs.landing, inputs.step)

    @contextlib.contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        """Run on the stream graphs are captured on, so lazily created per-stream state (GEMM
        workspaces, autotuning) exists before capture, ordered after the staged inputs."""
        if self._capture_stream is None:
            yield
            return
        self._capture_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._capture_stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self._capture_stream)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def build_graph_runner(
    model: object, capacity: Capacity, device: torch.device, *, rank: int, world_size: int
) -> DecodeGraphRunner:
    """The runner for a rank serving with ``capacity`` (the effective one, after the gate).

    State slots follow ``state_slot_layout(capacity.max_slots, cuda_graph=True)``; a row's page
    table is as wide as the longest request can need, bounded by the KV pool.
    """
    config = model.config
    longest = -(-config.max_position_embeddings // capacity.page_size)
    geometry = GraphGeometry(
        max_batch=capacity.max_slots,
        max_pages=min(capacity.kv_pages, longest),
        padding_page=capacity.kv_pages,
        spare_slot_base=state_slot_layout(capacity.max_slots, cuda_graph=True).spare_base,
        hidden_size=config.hidden_size,
        dtype=model.dtype,
        world_size=world_size,
    )
    return DecodeGraphRunner(model, geometry, device, rank=rank)


def precapture_handler(
    runner: DecodeGraphRunner | None, rank: int, on_finalize: Callable[[], None] | None = None
) -> Callable[[Precapture], Ack]:
    """The ``Precapture`` handler: one sweep phase; ``on_finalize`` (prefill graphs) after the last."""

    def handle(command: Precapture) -> Ack:
        if runner is None:
            raise WorkerStateError(f"precapture sent to rank {rank}, which runs decode without CUDA graphs")
        try:
            fault_point("precapture", rank)
            runner.run_phase(command.phase)
            if isinstance(command.phase, Finalize) and on_finalize is not None:
                on_finalize()
        except GraphError:
            raise
        except Exception as exc:
            raise GraphError(
                f"pre-capture {_phase_name(command.phase)} failed on rank {rank}: {type(exc).__name__}: {exc}"
            ) from exc
        return Ack()

    return handle


def _memory_in_use(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _phase_name(phase: PrecapturePhase) -> str:
    bucket = getattr(phase, "bucket", None)
    return type(phase).__name__ if bucket is None else f"{type(phase).__name__}({bucket})"
