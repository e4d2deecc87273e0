"""The host a benchmark ran on, printed beside its figures.

Host-bound rows (eager decode at small batch, where Python launching kernels is the step) follow
the CPU, and the CPUs behind one GPU kind differ: the same eager batch-1 step took 6.3 ms on one
H200 machine and 11-14 ms on others (2026-12-01). So each run names its CPU and times one cheap
host operation, a tensor allocation on the benchmark's device, as a measure of how fast that host
is at the kind of work an eager step is made of. It names the class of host, not its load at the
moment of each row: two processes in a row on one machine read eager batch 1 at 12.2 and 8.2 ms.
"""

from __future__ import annotations

import os
import platform
import time

import torch

_PROBE_CALLS = 2000


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def allocation_us(device: torch.device, calls: int = _PROBE_CALLS) -> float:
    """Host microseconds a call of ``torch.empty((1, 2560), bf16)`` on ``device`` takes (the median
    of five rounds): the caching allocator answers from its pool, so this is dispatch cost alone."""
    for _ in range(100):
        torch.empty((1, 2560), dtype=torch.bfloat16, device=device)
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            torch.empty((1, 2560), dtype=torch.bfloat16, device=device)
        rounds.append((time.perf_counter() - started) / calls * 1e6)
    return sorted(rounds)[len(rounds) // 2]


def host_line(device: torch.device) -> str:
    """One line naming the host and its measured allocation cost, e.g. ``host: Intel(R) Xeon(R)
    Processor, 16 cores; torch.empty on cuda 3.05 µs a call``."""
    return (
        f"host: {cpu_model()}, {usable_cores()} cores; "
        f"torch.empty on {device.type} {allocation_us(device):.2f} µs a call"
    )
