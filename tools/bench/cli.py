"""``phalanx bench KIND``: each benchmark lives in its own module, ``tools/bench/<kind>.py``."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "decode": ("phalanx.tools.bench.decode", "decode step time and prefill time on random weights"),
    "engine": (
        "phalanx.tools.bench.engine",
        "time per output token through the engine, pipelined decode or not",
    ),
    "serve": ("phalanx.tools.bench.serve", "TTFT / TPOT / ITL against a running server"),
    "roundtrip": ("phalanx.tools.bench.roundtrip", "protocol round trip to every rank, no model work"),
    "load": ("phalanx.tools.bench.load", "peak memory of one rank loading its shard"),
    "linear": (
        "phalanx.tools.bench.linear",
        "decode linears: Triton skinny GEMV/GEMM vs cuBLAS, in CUDA graphs",
    ),
    "gdn": (
        "phalanx.tools.bench.gdn",
        "GDN decode step per layer: fused kernel vs split path, in CUDA graphs",
    ),
    "host": ("phalanx.tools.bench.host", "host (Python) time of one eager decode step, per op"),
    "grammar": (
        "phalanx.tools.bench.grammar",
        "structured output on rank 0: grammar masks per step vs a plain pick",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="kind", required=True)
    for kind, (module_name, help_text) in BENCHMARKS.items():
        sub = kinds.add_parser(kind, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._module).run(args) or 0)
