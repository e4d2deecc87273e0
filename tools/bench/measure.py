"""What the decode benches share to time a step and report it: CUDA-event timing, a table row,
the kernel switches a figure depends on, and the per-kernel profile of a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (read + write)
PAGE_SIZE = 64  # tokens per KV page in every decode bench


def cuda_time_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


@dataclass
class Row:
    batch: int
    step_ms: float
    tokens_per_s: float
    roofline: float
    # Graph rows: the GPU's own time for the step (``graph_alone_ms``), without the host's share,
    # and a rank's pipelined step (``pipelined_ms``, tools/bench/decode_graph.py).
    graph_alone_ms: float | None = None
    pipelined_ms: float | None = None


def kernel_settings() -> str:
    """The kernel switches a figure depends on (``PHALANX_PDL``, ``PHALANX_LINEAR``), printed with it."""
    from phalanx.kernels.launch import pdl_enabled
    from phalanx.kernels.ops import LINEAR_BACKEND

    return f"PDL {'on' if pdl_enabled() else 'off'}, linears {LINEAR_BACKEND}"


def step_linears(model) -> list[str]:
    """The linears of one decode step in launch order, named as the profile's table names them."""
    from phalanx.models.qwen35.config import FULL_ATTENTION

    names = []
    for kind in model.config.layer_types:
        attention = kind == FULL_ATTENTION
        names += ["qkv_proj" if attention else "in_proj", "o_proj" if attention else "out_proj"]
        names += ["gate_up_proj", "down_proj"]
    return [*names, "lm_head"]


def print_profile(model, run: Callable[[], object], what: str) -> None:
    """Each kernel family's share of the step's critical path (``tools/bench/step_profile.py``)."""
    from phalanx.tools.bench.step_profile import profile_steps

    print(profile_steps(run, steps=3, labels=step_linears(model)).table(what), flush=True)
