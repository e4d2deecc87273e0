"""``phalanx bench engine``: time per output token through the whole engine, pipelined or not.

Writes a checkpoint of a Qwen3.5 geometry with random bf16 weights (fp32 on CPU) to a temporary
directory, then for each decode mode (``--modes``: ``pipelined``, the default scheduling, and
``blocking``, ``--no-pipeline``) starts an engine on it (coordinator, protocol, rank processes,
CUDA graphs with ``--cuda-graph``) and, for each batch size, submits that many greedy requests of
``--prompt-len`` random tokens at once (or ``--arrival-ms`` apart), each generating exactly
``--output-len`` tokens, after an untimed run of every batch size (the first run of a shape
compiles and tunes kernels). Tokens are timed as the engine's streams hand them over (no HTTP).

The figures cover the steady span, from the moment every request has its first token to the moment
the first one has its last: before it, prompts still being prefilled share the steps (how many
arrive with the first step is up to timing). TPOT is the median over requests of their time per
token in that span, ITL the median gap between consecutive tokens (with the 99th percentile and the longest
gap, where a stall of the host shows), and tokens/s the span's output. The last column is each
request's whole first-to-last span per token (median), prefills included. With ``--arrival-ms``
the requests arrive while the others decode, so every figure covers each request's own span from
its first token to its last instead: the admissions of the later ones fall inside it, which is
where a mode that stops decoding to admit a request shows.
At batch 1 the modes must generate the same tokens, which the run checks; a larger batch's make-up
at each step follows the requests' arrival, and with it the last bits of bf16 logits.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.tools.bench.args import at_least, milliseconds
from phalanx.tools.geometries import GEOMETRIES
from phalanx.tools.host_info import host_line
from phalanx.tools.random_checkpoint import write_random_checkpoint

MODES = {"pipelined": True, "blocking": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--geometry", choices=sorted(GEOMETRIES), default="4b", help="model shape (random weights)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the benchmark runs")
    parser.add_argument("--batch", default="1,16", help="comma-separated numbers of concurrent requests")
    parser.add_argument("--prompt-len", type=at_least(1), default=512, help="tokens of each prompt")
    parser.add_argument("--output-len", type=at_least(2), default=128, help="tokens each request generates")
    parser.add_argument(
        "--modes", default="pipelined,blocking", help="comma-separated decode modes: pipelined, blocking"
    )
    parser.add_argument(
        "--arrival-ms",
        type=milliseconds,
        default=0.0,
        help="submit each batch's requests this many ms apart (default 0: all at once)",
    )
    parser.add_argument("--cuda-graph", action="store_true", help="decode from CUDA graphs (cuda only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")


@dataclass
class Row:
    mode: str
    batch: int
    tpot_ms: float
    itl_ms: float
    itl_p99_ms: float  # nearest rank: 99 % of the span's gaps are no longer
    longest_gap_ms: float
    tokens_per_s: float
    whole_ms: float  # median over requests of first-to-last token time per token, prefills included


async def _timed_tokens(stream) -> tuple[list[int], list[float]]:
    from phalanx.engine.engine import ErrorEvent, TokenEvent

    tokens, times = [], []
    async for event in stream:
        if isinstance(event, TokenEvent):
            times.append(time.perf_counter())
            tokens.append(event.token_id)
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"request {stream.request_id} failed: {event.message}")
    return tokens, times


async def _generate(
    engine, prompts: list[list[int]], output_len: int, arrival_s: float = 0.0
) -> list[tuple[list[int], list[float]]]:
    from phalanx.engine.engine import GenerationParams

    params = GenerationParams(max_tokens=output_len, ignore_eos=True)
    timing = []
    for index, prompt in enumerate(prompts):
        if index and arrival_s:
            await asyncio.sleep(arrival_s)
        timing.append(asyncio.ensure_future(_timed_tokens(engine.submit(prompt, params))))
    return await asyncio.gather(*timing)


def _row(mode: str, batch: int, timed: list[tuple[list[int], list[float]]], staggered: bool = False) -> Row:
    """The figures over the span where every request decodes, or (``staggered``) over each
    request's own first to last token."""
    start = min(times[0] for _, times in timed) if staggered else max(times[0] for _, times in timed)
    end = max(times[-1] for _, times in timed) if staggered else min(times[-1] for _, times in timed)
    tpots, gaps, tokens = [], [], 0
    for _, times in timed:
        steady = [t for t in times if start <= t <= end]
        if len(steady) >= 2:
            tpots.append((steady[-1] - steady[0]) / (len(steady) - 1))
            gaps += [later - earlier for earlier, later in itertools.pairwise(steady)]
            tokens += len(steady) - 1
    if not tpots:
        raise RuntimeError(f"batch {batch}: no request decoded two tokens while all were decoding")
    whole = statistics.median((times[-1] - times[0]) / (len(times) - 1) for _, times in timed)
    gaps.sort()
    return Row(
        mode,
        batch,
        statistics.median(tpots) * 1e3,
        statistics.median(gaps) * 1e3,
        gaps[math.ceil(0.99 * len(gaps)) - 1] * 1e3,
        gaps[-1] * 1e3,
        tokens / (end - start),
        whole * 1e3,
    )


def run(args: argparse.Namespace) -> int:
    from phalanx.engine.engine import Engine, EngineConfig

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        print(
            f"phalanx bench engine: unknown mode {unknown[0] if unknown else '(none)'}; choose from {list(MODES)}"
        )
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("phalanx bench engine: needs a CUDA GPU (none is visible); --device cpu runs on the CPU")
        return 2
    batches = [int(b) for b in args.batch.split(",") if b]
    device = torch.device(args.device)
    vocab = int(GEOMETRIES[args.geometry]["vocab_size"])
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (max(batches), args.prompt_len), generator=generator).tolist()
    rows: list[Row] = []
    tokens_of: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-engine-") as tmp:
        started = time.perf_counter()
        size = write_random_checkpoint(args.geometry, Path(tmp), device, args.seed)
        print(
            f"wrote {args.geometry} with random weights ({size / 1e9:.2f} GB) in {time.perf_counter() - started:.1f} s"
        )
        if device.type == "cuda":
            print(host_line(device), flush=True)
        for mode in modes:
            config = EngineConfig(
                model_dir=tmp,
                device=args.device,
                max_slots=max(batches),
                kv_pages=0
                if device.type == "cuda"
                else max(batches) * -(-(args.prompt_len + args.output_len) // 16),
                max_batch_tokens=max(2048, args.prompt_len),
                cuda_graph=args.cuda_graph,
                pipeline=MODES[mode],
            )
            with Engine.start(config) as engine:
                for batch in batches:  # compiles and tunes every kernel the timed runs use
                    asyncio.run(_generate(engine, prompts[:batch], 4))
                for batch in batches:
                    arrival_s = args.arrival_ms / 1e3
                    timed = asyncio.run(_generate(engine, prompts[:batch], args.output_len, arrival_s))
                    rows.append(_row(mode, batch, timed, staggered=arrival_s > 0))
                    if batch == 1:
                        tokens_of[mode] = timed[0][0]
                    print(f"measured: {_line(rows[-1])}", flush=True)
    print(_table(args, rows))
    if len({tuple(tokens) for tokens in tokens_of.values()}) > 1:
        print("phalanx bench engine: the modes generated different tokens at batch 1", file=sys.stderr)
        return 1
    if len(tokens_of) > 1:
        print(f"every mode generated the same {args.output_len} tokens at batch 1")
    return 0


def _line(r: Row) -> str:
    return (
        f"| {r.mode} | {r.batch} | {r.tpot_ms:.3f} | {r.itl_ms:.3f} | {r.itl_p99_ms:.3f} | {r.longest_gap_ms:.3f} "
        f"| {r.tokens_per_s:.0f} | {r.whole_ms:.3f} |"
    )


def _table(args: argparse.Namespace, rows: list[Row]) -> str:
    graphs = "CUDA graphs" if args.cuda_graph else "eager"
    arrival = f", arriving {args.arrival_ms:g} ms apart" if args.arrival_ms else ""
    lines = [
        f"phalanx engine, {args.geometry}, {args.device}, {graphs}, TP 1: prompt {args.prompt_len}, "
        f"{args.output_len} output tokens a request{arrival}",
        "| decode | requests | TPOT ms (median) | ITL ms (median) | ITL p99 ms | longest gap ms | output tokens/s "
        "| first to last token, ms a token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [_line(r) for r in rows])
