"""Where a decode step's GPU time goes, kernel by kernel, as the step's critical path sees it.

Under programmatic dependent launch a kernel starts while the one before it drains and waits for
it inside, so summing kernel durations counts the overlap twice. Instead each kernel is charged
the time by which it moves the end of the step: its end minus the latest end of any kernel before
it (zero if it ends earlier). These charges add up to the step's GPU span exactly; an idle gap
before a kernel (the GPU waiting for it to be launched, as in eager decode) is charged to that
kernel. Linears can be named by their place in the step (``labels``: in_proj, out_proj... in
launch order).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Kernel families by name: the Triton kernels by their function names, cuBLAS by its prefixes.
_FAMILIES = [
    ("gemv", re.compile(r"gemv_kernel")),  # plain and pre-normed
    ("skinny gemm", re.compile(r"_skinny_gemm")),
    ("cuBLAS gemm", re.compile(r"nvjet|cutlass|sm90_xmma|gemm|gemv", re.IGNORECASE)),
    ("gdn step", re.compile(r"_step_kernel")),
    ("gdn conv", re.compile(r"_conv_decode")),
    ("decode attention + merge", re.compile(r"^_decode_kernel|_merge_kernel")),
    ("q/k norm + rope + kv write", re.compile(r"rope")),
    ("gated rms norm", re.compile(r"_gated_rms_norm")),
    ("rms norm", re.compile(r"_rms_norm")),
]


def family(name: str) -> str:
    for label, pattern in _FAMILIES:
        if pattern.search(name):
            return label
    return name[:48]


@dataclass
class StepProfile:
    steps: int
    span_us: float = 0.0  # first kernel start to last kernel end, summed over the steps
    kernels: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    critical_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    busy_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def table(self, what: str) -> str:
        per = 1.0 / self.steps
        lines = [
            f"critical path, {what} ({self.steps} steps; GPU span {self.span_us * per:.1f} us a step)",
            "| kernels | launches | on the critical path, us | us each | duration incl. PDL wait, us |",
            "|---|---|---|---|---|",
        ]
        for name in sorted(self.critical_us, key=self.critical_us.get, reverse=True):
            count = self.kernels[name] * per
            crit = self.critical_us[name] * per
            lines.append(
                f"| {name} | {count:.0f} | {crit:.1f} | {crit / max(count, 1):.2f} | {self.busy_us[name] * per:.1f} |"
            )
        return "\n".join(lines)


def kernel_events(run: Callable[[], object], steps: int) -> list[list[tuple[float, float, str]]]:
    """(start us, end us, name) of every GPU kernel, per call of ``run``, in start order. Each call
    runs inside a named range that ends after a CUDA synchronise, so a step's kernels all run
    within its range (the trace puts host and GPU times on one clock)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"{_STEP_RANGE} {i}"):
                run()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in trace
        # The host's range; the trace also mirrors it on the GPU's timeline ("gpu_user_annotation").
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(_STEP_RANGE)
    )
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace if e.get("cat") == "kernel" and "dur" in e
    )
    return [[k for k in kernels if lo <= k[0] < hi] for lo, hi in ranges]


_STEP_RANGE = "phalanx profiled step"


_LINEARS = ("gemv", "skinny gemm", "cuBLAS gemm")


def profile_steps(run: Callable[[], object], steps: int = 3, labels: list[str] | None = None) -> StepProfile:
    """``labels``: the step's linears in launch order; used where a step has exactly that many."""
    return attribute(kernel_events(run, steps), labels)


def attribute(per_step: list[list[tuple[float, float, str]]], labels: list[str] | None = None) -> StepProfile:
    """Charge each kernel of each step its share of the step's critical path."""
    result = StepProfile(steps=len(per_step))
    for events in per_step:
        if not events:
            continue
        families = [family(name) for _, _, name in events]
        linears = [i for i, f in enumerate(families) if f in _LINEARS]
        if labels is not None and len(linears) == len(labels):
            for i, label in zip(linears, labels, strict=True):
                families[i] = f"{families[i]}: {label}"
        latest_end = events[0][0]
        for (start, end, _), label in zip(events, families, strict=True):
            result.kernels[label] += 1
            result.busy_us[label] += end - start
            result.critical_us[label] += max(0.0, end - latest_end)
            latest_end = max(latest_end, end)
        result.span_us += latest_end - events[0][0]
    return result
