"""The CUDA-graph rows of ``phalanx bench decode``: the worker's graph runner after its whole
pre-capture sweep (timed), then each batch served as a rank serves it (rows staged, the bucket's
graph replayed), beside the graph alone on the GPU and the rank's pipelined step.

The pipelined figure is a rank's own step code (``worker.commands.StepRunner``: checks, staging,
replay, sampling, the tokens' way to the host) fed as the coordinator feeds it by default: each
step is launched, its rows ``FED_TOKEN``, before the tokens of the step ahead are read. Its time
per step is what a served request's time per output token comes to when the coordinator's round
trip fits in a GPU step (it is not in this figure).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from phalanx.tools.bench.measure import COPY_BANDWIDTH, PAGE_SIZE, Row, cuda_time_ms, print_profile
from phalanx.tools.bench.random_model import weight_bytes_per_step


def graph_decode_rows(
    model, batches: list[int], args: argparse.Namespace, device: torch.device
) -> tuple[list[Row], float]:
    """The serving graph path: the worker's graph runner, its whole pre-capture sweep (timed), then
    each step as a rank runs it (the rows staged in pinned memory, the bucket's graph replayed; its
    first kernel reads them) and the graph alone. Returns the rows and the sweep's seconds."""
    from phalanx.executor.precapture import run_precapture_sweep
    from phalanx.models.qwen35 import DecodeBatch
    from phalanx.protocol.messages import Capacity
    from phalanx.worker.buckets import state_slot_layout
    from phalanx.worker.graphs import build_graph_runner

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
        piped_ms = pipelined_ms(model, runner, capacity, device, tokens, pages, args)
        if args.profile:
            print_profile(model, run, f"batch {batch}")
        rows.append(
            Row(
                batch,
                step_ms,
                batch * 1e3 / step_ms,
                weight_bytes / (step_ms * 1e-3) / COPY_BANDWIDTH,
                graph_alone_ms=alone_ms,
                pipelined_ms=piped_ms,
            )
        )
    runner.release()
    return rows, sweep.seconds


def pipelined_ms(
    model,
    runner,
    capacity,
    device: torch.device,
    tokens: list[int],
    pages: list[list[int]],
    args: argparse.Namespace,
) -> float:
    """Wall time per step, the median over ``args.steps`` pipelined decode steps of ``len(tokens)``
    rows through a rank's ``StepRunner`` on ``runner``'s graphs (after ``args.warmup`` untimed ones):
    the gap between reading one step's tokens and the next's. The rows
    enter as requests whose prompt is cached (``args.context`` tokens, as the other rows assume)."""
    import time

    from phalanx.protocol.codec import pack_ids
    from phalanx.protocol.messages import FED_TOKEN, DecodeRow
    from phalanx.worker.commands import StepRunner
    from phalanx.worker.request_table import Phase

    step_runner = StepRunner(
        model, device, 0, capacity.page_size, capacity.kv_pages, capacity.max_slots, capacity.max_batch_tokens
    )
    step_runner.graphs = runner
    for request_id in range(1, len(tokens) + 1):
        state = step_runner.requests.begin(request_id)
        state.cached, state.phase = args.context, Phase.PREFILLED
    packed = [pack_ids(row_pages) for row_pages in pages]

    def rows(position: int, fed: bool) -> list[DecodeRow]:
        return [
            DecodeRow(r + 1, r, FED_TOKEN if fed else token, position, packed[r])
            for r, token in enumerate(tokens)
        ]

    ahead = step_runner.decode(rows(args.context, fed=False))
    # When each step's tokens were read, from the last warm-up step on: one gap a step.
    read_at = [time.perf_counter()] if args.warmup == 0 else []
    for step in range(1, args.warmup + args.steps + 1):
        following = step_runner.decode(rows(args.context + step, fed=True))
        ahead.results()
        if step >= args.warmup:
            read_at.append(time.perf_counter())
        ahead = following
    ahead.results()
    gaps = gaps_ms(read_at)
    # The median, as for the other columns: one slow step of the host does not move it.
    median = statistics.median(gaps)
    print(
        f"measured: pipelined batch {len(tokens)}: median {median:.4f} ms a step, "
        f"mean {statistics.fmean(gaps):.4f}, slowest {max(gaps):.4f}",
        flush=True,
    )
    return median


def gaps_ms(stamps: list[float]) -> list[float]:
    """The gaps between consecutive ``time.perf_counter()`` stamps, in ms."""
    if len(stamps) < 2:
        raise ValueError(f"pipelined figure: {len(stamps)} timestamps make no gap between steps")
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]


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
        "| batch | step ms | graph alone ms | pipelined ms | tokens/s | weight bytes / step time (of 4.3 TB/s) | vs eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for graph, eager in zip(graph_rows, eager_rows, strict=True):
        lines.append(
            f"| {graph.batch} | {graph.step_ms:.3f} | {graph.graph_alone_ms:.3f} | {graph.pipelined_ms:.3f} "
            f"| {graph.tokens_per_s:.0f} | {graph.roofline:.1%} | {eager.step_ms / graph.step_ms:.2f}x |"
        )
    return "\n".join(lines)
