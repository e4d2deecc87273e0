"""The race that decides, per decode-linear tuning key, between the tuned Triton kernel and cuBLAS.

Right after a key is tuned (eagerly, never inside a capture), both sides run on the same inputs,
each timed inside a small CUDA graph with an L2 flush before every call, as a decode graph runs
them: launches cost ~1 µs there and the weights come from HBM. The flush is a read (a written one
leaves L2 full of dirty lines, whose write-back then slows the op's weight reads), and its own time
is taken off both sides. cuBLAS must then beat Triton by 2 %, plus the ~1 µs a Triton kernel gains
under programmatic dependent launch in a real step, which this one-at-a-time timing cannot see.

The two sides' graphs (and the flush's own) replay in turn, round after round, and each side
takes its median: a GPU whose clock is still rising from idle when a process races its first keys
slows both sides alike; timed one side after the other, a process's first race could hand a
key to cuBLAS for the life of that process (docs/benchmarks/kernel-choices-h200.md).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import structlog
import torch

from phalanx.config import settings
from phalanx.kernels.launch import pdl_enabled

log = structlog.get_logger(__name__)

# cuBLAS must win by this much: a near tie goes to Triton, one launch where cuBLAS takes two or
# three when the op fuses a norm or SiLU (eager decode pays per launch). Near ties flipped from run to run.
_CUBLAS_MARGIN = 0.98
# What a Triton kernel gains in a decode graph from starting under the previous kernel's tail (PDL),
# which a cuBLAS launch does not get: about 1 µs a kernel (docs/benchmarks/kernel-choices-h200.md).
_PDL_CREDIT_US = 1.0
_RACE_CALLS = 4  # op calls per timed graph, each after an L2 flush
_RACE_REPLAYS = 7
_L2_FLUSH_BYTES = 128 << 20  # over twice the H200's 60 MB L2


def cublas_beats_triton(
    kernel: str,
    shape: dict[str, str],
    config: str | None,
    triton_run: Callable[[], object],
    cublas_run: Callable[[], object],
) -> bool:
    """Whether cuBLAS beats the tuned Triton kernel on this key (``shape`` and ``config`` name it
    in the log line). ``PHALANX_LINEAR=triton`` skips the race."""
    if settings.linear_backend() == "triton":
        return False
    triton_us, cublas_us = _race_us(triton_run, cublas_run)
    pdl_credit_us = _PDL_CREDIT_US if pdl_enabled() else 0.0
    faster = cublas_us + pdl_credit_us < _CUBLAS_MARGIN * triton_us
    log.info(
        "decode linear backend",
        kernel=kernel,
        **shape,
        triton_us=round(triton_us, 1),
        cublas_us=round(cublas_us, 1),
        pdl_credit_us=pdl_credit_us,
        picked="cublas" if faster else "triton",
        config=config,
    )
    return faster


@functools.cache
def _l2_flush_buffer(device: int) -> torch.Tensor:
    return torch.ones(_L2_FLUSH_BYTES // 8, dtype=torch.int64, device=f"cuda:{device}")


def _race_us(*runs: Callable[[], object]) -> list[float]:
    """µs of one call of each of ``runs`` from HBM: the median per call of its graph of (L2 flush,
    run) x _RACE_CALLS, less the same for the flush alone (~40 µs a call); the graphs replay in
    turn, one round after another, so a drifting clock slows every side alike."""
    graphs = [_graph(lambda: None), *(_graph(run) for run in runs)]
    for graph in graphs:  # a graph's first replay also uploads it: not timed
        _replay_us(graph)
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(_RACE_REPLAYS):
        for graph, replays in zip(graphs, times, strict=True):
            replays.append(_replay_us(graph))
    flush_us, *run_us = (statistics.median(replays) for replays in times)
    return [us - flush_us for us in run_us]


def _graph(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of (L2 flush, ``run``) x _RACE_CALLS: how the op runs in a decode graph, where
    launches cost ~1 µs and the weights come from HBM."""
    flush = _l2_flush_buffer(torch.cuda.current_device())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS workspaces and first launches outside the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(_RACE_CALLS):
            # Read, not written: a written flush leaves L2 full of dirty lines, whose write-back
            # then slows the op's weight reads (a decode graph's kernels leave almost none).
            flush.sum()
            run()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """µs per call of one replay of a ``_graph``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / _RACE_CALLS
