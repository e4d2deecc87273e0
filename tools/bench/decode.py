"""``phalanx bench decode``: decode step time and prefill time of a Qwen3.5 geometry on random weights.

The model is built through its public constructor from random bf16 tensors made directly on the
GPU, with the checkpoint's names and shapes (no download, no files). Each batch size decodes from
a context of ``--context`` tokens; after its first (tuning) step and ``--warmup`` more, the step
time is the median over ``--steps`` steps timed with CUDA events. The first steps of a process run
slower than later ones (eager batch 1 on one H200 machine: 8.12 ms over the 30 steps right after
tuning, 7.30 ms a few dozen steps on), so timing starts once they have passed. The header names
the host (``tools/host_info.py``): eager rows at small batch follow its CPU. The roofline figure
is the weight bytes one step must read over the step time, as a fraction of the H200's measured
4.3 TB/s copy bandwidth. ``--vs-transformers`` times transformers' ``Qwen3_5ForCausalLM`` with the
same geometry and random weights in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phalanx.tools.bench.args import at_least, integer_at_least, tp_degrees
from phalanx.tools.bench.decode_graph import graph_decode_rows, graph_table
from phalanx.tools.bench.decode_tp import multi_rank_requested, run_tp
from phalanx.tools.bench.measure import (
    COPY_BANDWIDTH,
    PAGE_SIZE,
    Row,
    cuda_time_ms,
    kernel_settings,
    print_profile,
)
from phalanx.tools.bench.random_model import build_random_model, weight_bytes_per_step
from phalanx.tools.geometries import GEOMETRIES, config_dict
from phalanx.tools.host_info import host_line
from phalanx.tools.launch_options import add_state_dtype_argument, chosen_state_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--geometry", choices=sorted(GEOMETRIES), default="4b", help="model shape (random weights)"
    )
    parser.add_argument("--batch", default="1,8,32,64", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=at_least(1), default=20, help="timed decode steps per batch size")
    parser.add_argument(
        "--warmup",
        type=warmup_steps,
        default=30,
        help="untimed decode steps per batch size before the timed ones",
    )
    parser.add_argument(
        "--context", type=at_least(0), default=512, help="tokens already in each row's KV cache"
    )
    parser.add_argument(
        "--prefill-len",
        type=prefill_length,
        default=4096,
        help="prompt length of the prefill figure (0: none)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time the serving graph path (pre-capture sweep, then bucketed graph replay)",
    )
    parser.add_argument("--vs-transformers", action="store_true", help="time transformers in the same run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    add_state_dtype_argument(parser)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print each kernel's share of a step's critical path, per batch",
    )
    parser.add_argument(
        "--tp",
        type=tp_degrees,
        default="1",
        help="comma-separated TP degrees, e.g. 1,2,4: each spawns that many ranks (one GPU each, NCCL)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the multi-rank path on gloo with fp32 weights (a check of the code path, not a benchmark)",
    )
    parser.add_argument(
        "--json",
        default=None,
        help="also write the multi-rank table, ratios and logits check to this file (default: none)",
    )


def prefill_length(text: str) -> int:
    """``--prefill-len``: a prompt length, or 0 for no prefill figure."""
    return integer_at_least(text, 0, "0 (no prefill figure) or a prompt length")


def warmup_steps(text: str) -> int:
    """``--warmup``: 0 or more untimed steps."""
    return integer_at_least(text, 0, "0 or more steps")


def decode_rows(model, batches: list[int], args: argparse.Namespace, device: torch.device) -> list[Row]:
    from phalanx.kernels.parallel_compile import parallel_compile
    from phalanx.models.qwen35 import DecodeBatch

    weight_bytes = weight_bytes_per_step(model)
    max_batch = max(batches)
    pages_per_row = -(-(args.context + args.steps + 8) // PAGE_SIZE)
    model.allocate_cache(max_batch * pages_per_row + 1, PAGE_SIZE, max_batch)
    rows = []
    for batch in batches:
        tokens = torch.randint(0, model.config.vocab_size, (batch,), device=device)
        page_table = torch.arange(batch * pages_per_row, device=device, dtype=torch.int32).view(batch, -1)
        step = DecodeBatch(
            tokens=tokens,
            positions=torch.full((batch,), args.context, dtype=torch.int64, device=device),
            state_slots=torch.arange(batch, device=device),
            page_table=page_table,
        )
        run = lambda step=step: model.decode(step)  # noqa: E731
        # The first step tunes this batch's kernels: their candidates compile side by side.
        with parallel_compile(ranks_here=1):
            run()
        for _ in range(args.warmup):
            run()
        torch.cuda.synchronize()
        step_ms = statistics.median(cuda_time_ms(run, args.steps))
        if args.profile:
            print_profile(model, run, f"batch {batch}")
        rows.append(
            Row(batch, step_ms, batch * 1e3 / step_ms, weight_bytes / (step_ms * 1e-3) / COPY_BANDWIDTH)
        )
        # Printed as measured, so a run cut short still leaves its figures.
        print(f"measured: {_row_line(rows[-1])}", flush=True)
    return rows


def prefill_ms(model, length: int, device: torch.device) -> float:
    from phalanx.models.qwen35 import PrefillBatch

    pages = -(-length // PAGE_SIZE)
    model.allocate_cache(pages + 1, PAGE_SIZE, 1)
    tokens = torch.randint(0, model.config.vocab_size, (length,)).tolist()
    batch = PrefillBatch.build([(tokens, 0, 0, list(range(pages)))], device)
    model.prefill(batch)  # compile
    torch.cuda.synchronize()
    return statistics.median(cuda_time_ms(lambda: model.prefill(batch), 3))


def transformers_rows(
    geometry: str, batches: list[int], args: argparse.Namespace, device: torch.device
) -> tuple[list[Row], float]:
    """Decode step (TPOT) and prefill time of transformers' model with the same geometry."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    raw = config_dict(geometry)
    raw.pop("full_attention_interval")
    hf_config = Qwen3_5TextConfig(**raw, initializer_range=0.02)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = Qwen3_5ForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(previous)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    rows = [_transformers_decode(hf, hf_config, batch, args, device, weight_bytes) for batch in batches]
    if not args.prefill_len:
        return rows, float("nan")
    prompt = torch.randint(0, hf_config.vocab_size, (1, args.prefill_len), device=device)
    with torch.inference_mode():
        hf(input_ids=prompt, use_cache=False)
        prefill = statistics.median(cuda_time_ms(lambda: hf(input_ids=prompt, use_cache=False), 2))
    return rows, prefill


@torch.inference_mode()
def _transformers_decode(
    hf, hf_config, batch: int, args: argparse.Namespace, device: torch.device, weight_bytes: int
) -> Row:
    from transformers import DynamicCache

    ids = torch.randint(0, hf_config.vocab_size, (batch, args.context), device=device)
    cache = DynamicCache(config=hf_config)
    last = [hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)]

    def step() -> None:
        last[0] = hf(input_ids=last[0], past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    step()
    step_ms = statistics.median(cuda_time_ms(step, max(3, min(args.steps, 10))))
    return Row(batch, step_ms, batch * 1e3 / step_ms, weight_bytes / (step_ms * 1e-3) / COPY_BANDWIDTH)


def _row_line(r: Row) -> str:
    return f"| {r.batch} | {r.step_ms:.3f} | {r.tokens_per_s:.0f} | {r.roofline:.1%} |"


def _table(title: str, rows: list[Row], prefill: float, prefill_len: int) -> str:
    lines = [
        title,
        "| batch | step ms | tokens/s | weight bytes / step time (of 4.3 TB/s) |",
        "|---|---|---|---|",
    ]
    lines += [_row_line(r) for r in rows]
    lines.append(
        f"prefill {prefill_len} tokens: {prefill:.1f} ms" if prefill_len else "prefill: not measured"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    # --tp other than 1 alone, --device cpu or --json: spawned ranks (tools/bench/decode_tp.py).
    if multi_rank_requested(args):
        return run_tp(args)
    if not torch.cuda.is_available():
        print("phalanx bench decode: needs a CUDA GPU (none is visible)")
        return 2
    device = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",") if b]
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    state_name = chosen_state_dtype(args, "bfloat16")
    state_dtype = getattr(torch, state_name)
    model = build_random_model(args.geometry, device, seed=args.seed, state_dtype=state_dtype)
    print(
        f"built {args.geometry} with random bf16 weights in {time.perf_counter() - started:.1f} s, "
        f"{state_name} recurrent state; "
        f"{weight_bytes_per_step(model) / 1e9:.2f} GB read per decode step; context {args.context}; "
        f"{kernel_settings()}"
    )
    print(host_line(device), flush=True)
    rows = decode_rows(model, batches, args, device)
    prefill = float("nan")
    if args.prefill_len:
        prefill = prefill_ms(model, args.prefill_len, device)
        print(f"measured: prefill {args.prefill_len} tokens {prefill:.1f} ms", flush=True)
    print(
        _table(
            f"phalanx {args.geometry} (eager, TP 1, {torch.cuda.get_device_name()})",
            rows,
            prefill,
            args.prefill_len,
        )
    )
    if args.cuda_graph:
        from phalanx.protocol.buckets import bucket_for

        graph_rows, sweep_s = graph_decode_rows(model, batches, args, device)
        print(
            f"phalanx {args.geometry} (CUDA graph, TP 1): pre-capture sweep of every bucket up to "
            f"{bucket_for(max(batches))} in {sweep_s:.1f} s"
        )
        print(graph_table(graph_rows, rows))
    if args.vs_transformers:
        del model
        torch.cuda.empty_cache()
        hf_rows, hf_prefill = transformers_rows(args.geometry, batches, args, device)
        torch.cuda.empty_cache()
        print(
            _table(f"transformers {args.geometry} (eager, same GPU)", hf_rows, hf_prefill, args.prefill_len)
        )
    return 0
