"""``phalanx bench decode --tp 1,2[,4]``: decode step time at several tensor-parallel degrees.

For each degree ``t``, ``t`` rank processes are spawned (torch.multiprocessing), one device each:
``cuda:r`` with NCCL, or the CPU with gloo (``--device cpu``, how CI runs this path). Every rank
builds its shard of one random model: each global tensor is generated from its own seed (the run's
seed and the tensor's name), then cut to the rank's slices (``models.qwen35.sharding``), so every TP
degree computes the same function. All ranks run the same steps, so every step's collectives pair
them up; rank 0 times them (CUDA events on CUDA). With ``--cuda-graph`` the serving graph path is
timed too: the worker's graph runner after the whole pre-capture sweep, each phase followed by a
barrier on every rank, as the coordinator's dispatch makes it one. Rank 0 writes its figures and
the logits of its first eager step to a file; the parent prints one table, the TP scaling
targets, and how far each degree's logits are from TP 1's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from phalanx.tools.bench.measure import (
    COPY_BANDWIDTH,
    PAGE_SIZE,
    cuda_time_ms,
    kernel_settings,
    print_profile,
)
from phalanx.tools.bench.random_model import build_sharded_model, weight_bytes_per_step
from phalanx.tools.bench.ranks import finish_rank, host_barrier, init_rank, run_ranks
from phalanx.tools.launch_options import state_dtype_setting

TARGET_TP2_BATCH1 = 0.6  # TP scaling target: TP 2 batch-1 step time <= 0.6 x TP 1
TARGET_GRAPH_SPEEDUP = 1.3  # graphs must pay: >= 1.3 x eager at TP 2, batch 16


def multi_rank_requested(args: argparse.Namespace) -> bool:
    """Whether ``bench decode`` takes this path: any TP degree but 1 alone, CPU, or JSON output."""
    return args.tp != [1] or args.device == "cpu" or args.json is not None


# ------------------------------------------------------------------------------ one rank's work


@dataclass(frozen=True)
class BenchSettings:
    geometry: str
    batches: tuple[int, ...]
    steps: int
    context: int
    cuda_graph: bool
    seed: int
    device: str  # "cuda" or "cpu"
    warmup: int = 30  # untimed steps before each row's timed ones (``--warmup``)
    profile: bool = False  # rank 0 prints the top GPU kernels of three steps per row (CUDA)
    recurrent_state_dtype: str = ""  # ``--mamba-ssm-cache-dtype``; "": the model's


def _time_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    if device.type == "cuda":
        return statistics.median(cuda_time_ms(fn, repeats))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


@dataclass
class RankRun:
    """What one rank's measurements share: the settings, its place, its model and cache geometry."""

    settings: BenchSettings
    rank: int
    world_size: int
    device: torch.device
    model: object
    weight_bytes: int
    pages_per_row: int
    kv_pages: int

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"[tp {self.world_size}] {text}", flush=True)

    def inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's host inputs, the same at every TP degree: tokens, state slots, page table."""
        gen = torch.Generator().manual_seed(self.settings.seed + batch)
        tokens = torch.randint(0, self.model.config.vocab_size, (batch,), generator=gen)
        page_table = torch.arange(batch * self.pages_per_row, dtype=torch.int32).view(batch, -1)
        return tokens, torch.arange(batch), page_table

    def measure(self, run: Callable[[], object], mode: str, batch: int) -> dict[str, object]:
        for _ in range(max(self.settings.warmup, 1)):  # the first run of a mode tunes its kernels
            run()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_ms = _time_ms(run, self.settings.steps, self.device)
        row = {
            "geometry": self.settings.geometry,
            "tp": self.world_size,
            "mode": mode,
            "batch": batch,
            "step_ms": step_ms,
            "tokens_per_s": batch * 1e3 / step_ms,
            "roofline_per_gpu": self.weight_bytes / (step_ms * 1e-3) / COPY_BANDWIDTH,
        }
        # Printed as measured, so a run cut short still leaves its figures.
        self.say(f"measured: {_row_line(self.settings.geometry, row)}")
        if self.settings.profile and self.device.type == "cuda":
            self._profile(run, f"tp {self.world_size} {mode}, batch {batch}")
        return row

    def _profile(self, run: Callable[[], object], what: str) -> None:
        """Every rank runs the same three steps (they meet in collectives); rank 0 profiles them."""
        if self.rank != 0:
            for _ in range(3):
                run()
            torch.cuda.synchronize(self.device)
            return
        print_profile(self.model, run, what)


def bench_rank(rank: int, world_size: int, init_method: str, settings: BenchSettings, out_path: str) -> None:
    """One rank of one TP degree: build the shard, time eager (and graph) decode per batch size."""
    from phalanx.models.qwen35 import recurrent_state_dtype
    from phalanx.worker.buckets import state_slot_layout

    if rank != 0:  # one rank's log lines tell the story; the others only warn
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    device = init_rank(rank, world_size, init_method, settings.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    state_dtype = recurrent_state_dtype(settings.recurrent_state_dtype, dtype)
    model = build_sharded_model(
        settings.geometry, rank, world_size, device, dtype, settings.seed, state_dtype
    )
    model.tp.enable_one_shot(dtype, device)  # as a serving rank does (PHALANX_ALL_REDUCE=nccl: off)
    built_s = time.perf_counter() - started
    max_batch = max(settings.batches)
    pages_per_row = -(-(settings.context + settings.steps + settings.warmup + 8) // PAGE_SIZE)
    run = RankRun(
        settings,
        rank,
        world_size,
        device,
        model,
        weight_bytes_per_step(model),
        pages_per_row,
        kv_pages=max_batch * pages_per_row,
    )
    model.allocate_cache(run.kv_pages + 1, PAGE_SIZE, state_slot_layout(max_batch, cuda_graph=True).total)
    run.say(
        f"built {settings.geometry} shard in {built_s:.1f} s; {run.weight_bytes / 1e9:.2f} GB per step per rank"
    )
    rows, first_logits = _eager_rows(run)
    sweep_s = None
    if settings.cuda_graph:
        graph_rows, sweep_s = _graph_rows(run)
        rows += graph_rows
    if rank == 0:
        result = {
            "rows": rows,
            "sweep_s": sweep_s,
            "build_s": built_s,
            "weight_bytes_per_rank": run.weight_bytes,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "kernels": kernel_settings(),
            "first_logits": first_logits,
            "first_batch": settings.batches[0],
        }
        torch.save(result, out_path)
    finish_rank()


def _eager_rows(run: RankRun) -> tuple[list[dict[str, object]], torch.Tensor]:
    """Plain ``model.decode`` per batch size; also the logits of the very first step (fresh state)."""
    from phalanx.models.qwen35 import DecodeBatch

    rows, first_logits = [], None
    for batch in run.settings.batches:
        tokens, slots, page_table = run.inputs(batch)
        step = DecodeBatch(
            tokens=tokens.to(run.device),
            positions=torch.full((batch,), run.settings.context, dtype=torch.int64, device=run.device),
            state_slots=slots.to(run.device),
            page_table=page_table.to(run.device),
        )
        logits = run.model.decode(step)
        if first_logits is None:
            first_logits = logits.float().cpu()
        rows.append(run.measure(lambda step=step: run.model.decode(step), "eager", batch))
    return rows, first_logits


def _graph_rows(run: RankRun) -> tuple[list[dict[str, object]], float]:
    """The serving graph path: the whole pre-capture sweep in lockstep, then bucketed replays."""
    from phalanx.executor.precapture import run_precapture_sweep
    from phalanx.models.qwen35 import DecodeBatch
    from phalanx.protocol.messages import Capacity
    from phalanx.worker.graphs import build_graph_runner

    capacity = Capacity(run.kv_pages, PAGE_SIZE, max(run.settings.batches), 1)
    runner = build_graph_runner(run.model, capacity, run.device, rank=run.rank, world_size=run.world_size)
    barrier = host_barrier()

    def send(phase) -> None:
        runner.run_phase(phase)
        barrier()  # as the coordinator's dispatch: no rank starts a phase before all ended the last

    sweep = run_precapture_sweep(send, runner.buckets, progress=False)
    mode = "graph" if runner.uses_cuda_graphs else "static-eager"
    rows = []
    for batch in run.settings.batches:
        tokens, slots, page_table = run.inputs(batch)
        # Built from its rows as the worker builds a Decode command's batch (host arrays and all).
        context = [run.settings.context] * batch
        columns = (tokens.tolist(), context, slots.tolist(), page_table.tolist())
        step = DecodeBatch.build(list(zip(*columns, strict=True)))
        rows.append(run.measure(lambda step=step: runner.decode(step), mode, batch))
    runner.release()
    return rows, sweep.seconds


# ------------------------------------------------------------------------------ the parent's report


def run_tp(args: argparse.Namespace) -> int:
    degrees = args.tp
    if args.device == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < max(degrees):
            print(
                f"phalanx bench decode: TP {max(degrees)} needs {max(degrees)} CUDA GPUs, {visible} visible"
            )
            return 2
    settings = BenchSettings(
        geometry=args.geometry,
        batches=tuple(int(b) for b in args.batch.split(",") if b),
        steps=args.steps,
        context=args.context,
        cuda_graph=args.cuda_graph,
        seed=args.seed,
        device=args.device,
        warmup=args.warmup,
        profile=args.profile,
        recurrent_state_dtype=state_dtype_setting(args),
    )
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-tp-") as scratch:
        for tp in degrees:
            out_path = str(Path(scratch) / f"tp{tp}.pt")
            run_ranks(bench_rank, tp, (settings, out_path))
            results[tp] = torch.load(out_path, weights_only=False)
    report = summarize(settings, results)
    print(format_report(report))
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def summarize(settings: BenchSettings, results: dict[int, dict]) -> dict[str, object]:
    """Every row with its ratios (vs TP 1, vs eager), the issue's targets and the logits check."""
    rows = [dict(row) for tp in sorted(results) for row in results[tp]["rows"]]
    by_key = {(r["tp"], r["mode"], r["batch"]): r for r in rows}
    for r in rows:
        base = by_key.get((1, r["mode"], r["batch"]))
        r["vs_tp1"] = r["step_ms"] / base["step_ms"] if base is not None else None
        eager = by_key.get((r["tp"], "eager", r["batch"]))
        r["speedup_vs_eager"] = eager["step_ms"] / r["step_ms"] if r["mode"] != "eager" and eager else None
    targets = {}
    for mode in ("eager", "graph"):
        row = by_key.get((2, mode, 1))
        if row is not None and row["vs_tp1"] is not None:
            targets[f"tp2_over_tp1_batch1_{mode}"] = row["vs_tp1"]
    graph16 = by_key.get((2, "graph", 16))
    if graph16 is not None:
        targets["graph_over_eager_tp2_batch16"] = graph16["speedup_vs_eager"]
    any_result = next(iter(results.values()))
    return {
        "geometry": settings.geometry,
        "device": settings.device,
        "device_name": any_result["device_name"],
        "kernels": any_result["kernels"],
        "context": settings.context,
        "steps": settings.steps,
        "rows": rows,
        "sweep_s": {str(tp): results[tp]["sweep_s"] for tp in sorted(results)},
        "build_s": {str(tp): results[tp]["build_s"] for tp in sorted(results)},
        "targets": targets,
        "logits_vs_tp1": _logits_vs_tp1(results),
    }


def _logits_vs_tp1(results: dict[int, dict]) -> dict[str, dict[str, float]]:
    """The first eager step's logits of each degree against TP 1's (same global weights and inputs)."""
    if 1 not in results:
        return {}
    ref = results[1]["first_logits"]
    out = {}
    for tp in sorted(results):
        if tp == 1:
            continue
        got = results[tp]["first_logits"]
        out[str(tp)] = {
            "batch": results[tp]["first_batch"],
            "max_abs_diff_over_max_abs_ref": float((got - ref).abs().max() / ref.abs().max()),
            "relative_norm_error": float((got - ref).norm() / ref.norm()),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        }
    return out


def _row_line(geometry: str, r: dict[str, object]) -> str:
    return (
        f"| {geometry} | {r['tp']} | {r['mode']} | {r['batch']} | {r['step_ms']:.2f} | "
        f"{r['tokens_per_s']:.0f} | {r['roofline_per_gpu']:.1%} |"
    )


def _ratio(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def format_report(report: dict[str, object]) -> str:
    lines = [
        f"phalanx decode, {report['geometry']} geometry, random weights, context {report['context']}, "
        f"median of {report['steps']} steps, {report['device_name']}, {report['kernels']}",
        "| geometry | tp | mode | batch | step ms | tokens/s | weight bytes per GPU / step time "
        "(of 4.3 TB/s) | step vs TP 1 | speedup vs eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"{_row_line(report['geometry'], r)} {_ratio(r['vs_tp1'], 'x')} | {_ratio(r['speedup_vs_eager'], 'x')} |"
        )
    for tp, seconds in report["sweep_s"].items():
        if seconds is not None:
            lines.append(f"pre-capture sweep at TP {tp}: {seconds:.1f} s")
    targets = report["targets"]
    for mode in ("eager", "graph"):
        value = targets.get(f"tp2_over_tp1_batch1_{mode}")
        if value is not None:
            verdict = "meets" if value <= TARGET_TP2_BATCH1 else "misses"
            lines.append(
                f"TP 2 / TP 1 step time at batch 1 ({mode}): {value:.2f} "
                f"({verdict} the target <= {TARGET_TP2_BATCH1})"
            )
    speedup = targets.get("graph_over_eager_tp2_batch16")
    if speedup is not None:
        verdict = "meets" if speedup >= TARGET_GRAPH_SPEEDUP else "misses"
        lines.append(
            f"graph vs eager at TP 2, batch 16: {speedup:.2f}x ({verdict} the target >= {TARGET_GRAPH_SPEEDUP}x)"
        )
    for tp, check in report["logits_vs_tp1"].items():
        lines.append(
            f"first-step logits at TP {tp} vs TP 1 (batch {check['batch']}): max|diff|/max|ref| "
            f"{check['max_abs_diff_over_max_abs_ref']:.3g}, relative norm error "
            f"{check['relative_norm_error']:.3g}, top-1 agreement {check['top1_agreement']:.0%}"
        )
    return "\n".join(lines)
