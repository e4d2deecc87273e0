"""``phalanx bench linear``: the decode linears, Triton skinny GEMV/GEMM against cuBLAS, per shape and whole.

Shapes are one TP rank's linear weights of a Qwen3.5 geometry, taken from the loader's own tensor
specs (fused projections as the model holds them): GDN in_proj/out_proj, attention qkv/o, the MLP's
gate_up (timed as the fused gate_up + SiLU-and-mul, against cuBLAS + the SiLU-and-mul kernel, which
is what the model runs with ``PHALANX_LINEAR=cublas``), down, and the vocab head.

Every figure is timed inside a CUDA graph so Python launch cost is excluded: per shape, ``--calls``
back-to-back calls cycling over enough distinct weight copies that the weights stream from HBM,
not L2; the whole set is every linear of one decode step (each matrix its own tensor) in one graph.
Bandwidth is weight bytes over time (activations are negligible at these batch sizes), against the
H200's measured 4.3 TB/s copy bandwidth. Each path runs once eagerly before capture, so Triton's
compile and autotuning (slow the first time on a machine) happen outside the timed graphs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from phalanx.tools.bench.args import at_least

COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (read + write)
L2_FLUSH_BYTES = 256e6  # several times the H200's 60 MB L2: copies per shape cover at least this
BACKENDS = ("triton", "cublas")


@dataclass(frozen=True)
class LinearShape:
    name: str  # the weight's role, e.g. "linear_attn.in_proj"
    n: int  # weight rows (output features)
    k: int  # weight columns (input features)
    count: int  # matrices of this shape in one decode step
    fused_silu: bool  # gate_up: timed as the fused gate_up + SiLU-and-mul

    @property
    def bytes(self) -> int:
        return self.n * self.k * 2  # bf16


@dataclass(frozen=True)
class Timing:
    geometry: str
    shape: str
    n: int
    k: int
    m: int
    triton_us: float
    cublas_us: float
    weight_bytes: int
    max_rel_error: float

    def tb_s(self, us: float) -> float:
        return self.weight_bytes / (us * 1e-6) / 1e12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", default="4b", help="comma-separated geometries, e.g. 4b,9b")
    parser.add_argument("--tp", type=at_least(1), default=1, help="time one rank's shards at this TP degree")
    parser.add_argument("--m", default="1,16,64", help="comma-separated row counts (decode batch sizes)")
    parser.add_argument(
        "--calls", type=at_least(1), default=20, help="back-to-back calls per per-shape graph"
    )
    parser.add_argument(
        "--replays", type=at_least(1), default=20, help="timed graph replays (median is reported)"
    )
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-model-set totals")
    parser.add_argument("--json", default=None, help="also write every figure to this file (default: none)")


def linear_shapes(geometry: str, tp: int) -> list[LinearShape]:
    """One rank's linear weights of ``geometry`` at TP ``tp``, grouped by role, in layer order."""
    from phalanx.models.qwen35.config import Qwen35Config
    from phalanx.models.qwen35.sharding import RankLayout, tensor_specs
    from phalanx.tools.geometries import config_dict

    config = Qwen35Config.from_dicts(config_dict(geometry), source=f"geometry {geometry}")
    layout = RankLayout.build(config, 0, tp)
    rows: dict[str, list[int]] = {}  # full key -> [rows, cols]; fused parts add their rows
    for spec in tensor_specs(config, layout, include_lm_head=False):
        if spec.key.endswith("_proj.weight") and len(spec.local_shape) == 2:
            n, k = spec.local_shape
            rows.setdefault(spec.key, [0, k])[0] += n
    roles: dict[tuple[str, int, int], int] = {}
    for key, (n, k) in rows.items():
        role = key.split(".", 2)[2].removesuffix(".weight")  # drop "layers.{i}."
        roles[(role, n, k)] = roles.get((role, n, k), 0) + 1
    shapes = [
        LinearShape(role, n, k, count, role.endswith("gate_up_proj")) for (role, n, k), count in roles.items()
    ]
    shapes.append(LinearShape("lm_head", layout.vocab, config.hidden_size, 1, False))
    return shapes


def _op(backend: str, fused_silu: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from phalanx.kernels.activation_triton import silu_and_mul_triton
    from phalanx.kernels.linear_triton import linear_silu_and_mul_triton, linear_triton

    if backend == "triton":
        return linear_silu_and_mul_triton if fused_silu else linear_triton
    if fused_silu:
        return lambda x, w: silu_and_mul_triton(F.linear(x, w))
    return F.linear


def _bound(
    op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor
) -> Callable[[], torch.Tensor]:
    return lambda: op(x, w)


def graph_time_us(calls: list[Callable[[], object]], replays: int) -> float:
    """Median time of one replay of a CUDA graph holding ``calls``, run once eagerly first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and cuBLAS workspaces outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def _random(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, cols, device="cuda", generator=gen) * cols**-0.5).to(torch.bfloat16)


def _max_rel_error(shape: LinearShape, x: torch.Tensor, w: torch.Tensor) -> float:
    out = _op("triton", shape.fused_silu)(x, w).double()
    ref = _op("cublas", shape.fused_silu)(x, w).double()
    return float(((out - ref).norm() / ref.norm().clamp_min(1e-12)).item())


def time_shape(
    geometry: str, shape: LinearShape, ms: list[int], args: argparse.Namespace, gen: torch.Generator
) -> list[Timing]:
    copies = min(args.calls, max(1, math.ceil(L2_FLUSH_BYTES / shape.bytes)))
    weights = [_random(shape.n, shape.k, gen) for _ in range(copies)]
    timings = []
    for m in ms:
        x = torch.randn(m, shape.k, device="cuda", generator=gen).to(torch.bfloat16)
        per_call = {}
        for backend in BACKENDS:
            op = _op(backend, shape.fused_silu)
            calls = [_bound(op, x, weights[i % copies]) for i in range(args.calls)]
            per_call[backend] = graph_time_us(calls, args.replays) / args.calls
        error = _max_rel_error(shape, x, weights[0])
        timings.append(
            Timing(
                geometry,
                shape.name,
                shape.n,
                shape.k,
                m,
                per_call["triton"],
                per_call["cublas"],
                shape.bytes,
                error,
            )
        )
        print(_timing_line(timings[-1]), flush=True)
    del weights
    torch.cuda.empty_cache()
    return timings


def time_whole_set(
    geometry: str, shapes: list[LinearShape], ms: list[int], args: argparse.Namespace, gen: torch.Generator
) -> list[dict[str, object]]:
    """Every linear of one decode step, each matrix its own tensor, in one graph per backend."""
    weights = [(shape, _random(shape.n, shape.k, gen)) for shape in shapes for _ in range(shape.count)]
    total_bytes = sum(shape.bytes for shape, _ in weights)
    results = []
    for m in ms:
        xs = {
            k: torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            for k in {s.k for s in shapes}
        }
        row: dict[str, object] = {
            "geometry": geometry,
            "m": m,
            "matrices": len(weights),
            "weight_bytes": total_bytes,
        }
        for backend in BACKENDS:
            calls = [_bound(_op(backend, s.fused_silu), xs[s.k], w) for s, w in weights]
            us = graph_time_us(calls, args.replays)
            row[f"{backend}_us"] = us
            row[f"{backend}_tb_s"] = total_bytes / (us * 1e-6) / 1e12
        results.append(row)
        print(
            f"| {geometry} all {len(weights)} linears ({total_bytes / 1e9:.2f} GB) | {m} "
            f"| {row['triton_us'] / 1e3:.3f} ms {row['triton_tb_s']:.2f} TB/s "
            f"| {row['cublas_us'] / 1e3:.3f} ms {row['cublas_tb_s']:.2f} TB/s "
            f"| {float(row['cublas_us']) / float(row['triton_us']):.2f}x |",
            flush=True,
        )
    del weights
    torch.cuda.empty_cache()
    return results


def _timing_line(t: Timing) -> str:
    return (
        f"| {t.geometry} {t.shape} | {t.n}x{t.k} | {t.weight_bytes / 1e6:.1f} | {t.m} "
        f"| {t.triton_us:.2f} | {t.tb_s(t.triton_us):.2f} | {t.cublas_us:.2f} | {t.tb_s(t.cublas_us):.2f} "
        f"| {t.cublas_us / t.triton_us:.2f}x | {t.max_rel_error:.1e} |"
    )


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("phalanx bench linear: needs a CUDA GPU (none is visible)")
        return 2
    geometries = [g for g in args.geometry.split(",") if g]
    ms = [int(m) for m in args.m.split(",") if m]
    gen = torch.Generator(device="cuda").manual_seed(0)
    started = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, TP {args.tp} shards, {args.calls} calls per graph")
    print(
        "| shape | N x K | MB | M | triton µs | triton TB/s | cuBLAS µs | cuBLAS TB/s | speed-up | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    timings: list[Timing] = []
    shapes_of = {g: linear_shapes(g, args.tp) for g in geometries}
    for geometry in geometries:
        for shape in shapes_of[geometry]:
            timings += time_shape(geometry, shape, ms, args, gen)
    whole: list[dict[str, object]] = []
    if not args.no_whole:
        print("| whole decode step | M | triton | cuBLAS | speed-up |")
        print("|---|---|---|---|---|")
        for geometry in geometries:
            whole += time_whole_set(geometry, shapes_of[geometry], ms, args, gen)
    print(f"done in {time.perf_counter() - started:.0f} s (includes Triton compile and autotuning)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tp": args.tp, "shapes": [asdict(t) for t in timings], "whole": whole}, f, indent=1)
    return 0
