"""The race that decides, per decode-linear tuning key, between the tuned Triton kernel and cuBLAS.

Right after a key is tuned (eagerly, never inside a capture), both sides run on the same inputs,
each timed inside a small CUDA graph with an L2 flush before every call, as a decode graph runs
them: launches cost ~1 µs there and the weights come from HBM. The flush is a read (a written one
leaves L2 full of dirty lines, whose write-back then slows the op's weight reads), and its own time
is taken off both sides. cuBLAS must then beat Triton by 2 %, plus the ~1 µs a Triton kernel gains
under programmatic dependent launch in a real step, which this one-at-a-time timing cannot see.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable

import structlog
import torch

from kernels.launch import pdl_enabled

log = structlog.get_logger(__name__)

# cuBLAS must win by this much: a near tie goes to Triton, one launch where cuBLAS takes two or
# three when the op fuses a norm or SiLU (eager decode pays per launch). Near ties flipped from run to run.
_CUBLAS_MARGIN = 0.98
# What a Triton kernel gains in a decode graph from starting under the previous kernel's tail (PDL),
# which a cuBLAS launch does not get: on the H200, PDL took 0.2 ms off a 4B batch-1 graph step of
# ~190 kernels, about 1 µs each.
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
    if os.environ.get("PHALANX_LINEAR", "auto").strip().lower() == "triton":
        return False
    triton_us = _op_us(triton_run)
    cublas_us = _op_us(cublas_run)
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


def _op_us(run: Callable[[], object]) -> float:
    """µs of one call of ``run`` from HBM: ``_graph_us`` less what the L2 flush alone adds to each
    call (~40 µs), so the race's margin compares the ops themselves."""
    return _graph_us(run) - _flush_us(torch.cuda.current_device())


@functools.cache
def _flush_us(device: int) -> float:
    return _graph_us(lambda: None)


def _graph_us(run: Callable[[], object]) -> float:
    """Median µs of one replay of a CUDA graph of (L2 flush, ``run``) x _RACE_CALLS, divided by the
    calls: how the op runs in a decode graph, where launches cost ~1 µs and the weights come from HBM."""
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
    times = []
    for _ in range(_RACE_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / _RACE_CALLS)
    del graph
    return statistics.median(times)
