"""The CUDA-graph rows of ``phalanx bench decode``: the worker's graph runner after its whole
pre-capture sweep (timed), then each batch served as a rank serves it (rows staged, the bucket's
graph replayed), beside the graph alone on the GPU."""

from __future__ import annotations

import argparse
import statistics

import torch

from tools.bench_decode import (
    COPY_BANDWIDTH,
    PAGE_SIZE,
    Row,
    cuda_time_ms,
    print_profile,
    weight_bytes_per_step,
)


def graph_decode_rows(
    model, batches: list[int], args: argparse.Namespace, device: torch.device
) -> tuple[list[Row], float]:
    """The serving graph path: the worker's graph runner, its whole pre-capture sweep (timed), then
    each step as a rank runs it (the rows staged in pinned memory, the bucket's graph replayed; its
    first kernel reads them) and the graph alone. Returns the rows and the sweep's seconds."""
    from executor.precapture import run_precapture_sweep
    from models.qwen35 import DecodeBatch
    from protocol.messages import Capacity
    from worker.buckets import state_slot_layout
    from worker.graphs import build_graph_runner

    weight_bytes = weight_bytes_per_step(model)
    max_batch = max(batches)
    pages_per_row = -(-(args.context + args.steps + 8) // PAGE_SIZE)
    kv_pages = max_batch * pages_per_row
    model.allocate_cache(kv_pages + 1, PAGE_SIZE, state_slot_layout(max_batch, cuda_graph=True).total)
    capacity = Capacity(kv_pages, PAGE_SIZE, max_batch, max(args.prefill_len, 1))
    runner = build_graph_runner(model, capacity, device, rank=0, world_size=1)
    sweep = run_precapture_sweep(runner.run_phase, runner.buckets)
    rows = []
    for batch in batches:
        # Built from its rows as the worker builds a Decode command's batch (host arrays and all).
        tokens = torch.randint(0, model.config.vocab_size, (batch,)).tolist()
        pages = torch.arange(batch * pages_per_row).view(batch, -1).tolist()
        step = DecodeBatch.build([(tokens[r], args.context, r, pages[r]) for r in range(batch)])
        run = lambda step=step: runner.decode(step)  # noqa: E731
        for _ in range(args.warmup):  # the sweep's Launch phase replayed each graph once already
            run()
        torch.cuda.synchronize()
        step_ms = statistics.median(cuda_time_ms(run, args.steps))
        alone_ms = graph_alone_ms(runner, args.steps)
        if args.profile:
            print_profile(model, run, f"batch {batch}")
        rows.append(
            Row(
                batch,
                step_ms,
                batch * 1e3 / step_ms,
                weight_bytes / (step_ms * 1e-3) / COPY_BANDWIDTH,
                graph_alone_ms=alone_ms,
            )
        )
    runner.release()
    return rows, sweep.seconds


def graph_alone_ms(runner, steps: int) -> float:
    """The GPU's own time for a step: the last decode's graph replayed ``steps`` times back to back
    (``DecodeGraphRunner.replay_last``), timed from the end of one untimed replay so that no launch
    latency is in the span. A served step adds the host's share to it: staging its rows, then the
    replay call, while the GPU waits."""
    runner.replay_last(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    runner.replay_last(steps)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def graph_table(graph_rows: list[Row], eager_rows: list[Row]) -> str:
    """The graph rows: the served step (staging + replay, as a rank runs it), the graph alone on the
    GPU, and the ratio to the eager step of the same batch."""
    lines = [
        "| batch | step ms | graph alone ms | tokens/s | weight bytes / step time (of 4.3 TB/s) | vs eager |",
        "|---|---|---|---|---|---|",
    ]
    for graph, eager in zip(graph_rows, eager_rows, strict=True):
        lines.append(
            f"| {graph.batch} | {graph.step_ms:.3f} | {graph.graph_alone_ms:.3f} | {graph.tokens_per_s:.0f} | {graph.roofline:.1%} "
            f"| {eager.step_ms / graph.step_ms:.2f}x |"
        )
    return "\n".join(lines)
