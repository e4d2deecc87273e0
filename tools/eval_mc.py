"""``phalanx eval-mc``: multiple-choice accuracy of a served model over the chat completions API.

Datasets are local JSONL or parquet files (format: docs/eval-mc.md); nothing is downloaded.
Results go to ``--out``: ``{bench}_samples.partial.jsonl`` (the checkpoint), ``{bench}_samples.json``,
``{bench}_summary.json``. Exit status 0: complete; 2: incomplete (API errors remain); 1: unusable
input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from phalanx.tools.evalmc.client import ChatSettings
from phalanx.tools.evalmc.data import DatasetError, load_paths, stratified_sample
from phalanx.tools.evalmc.recipes import RECIPES, build_prompts
from phalanx.tools.evalmc.rerun import RerunError, rerun_truncated
from phalanx.tools.evalmc.runner import RunFiles, run_benchmark

EXIT_INCOMPLETE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bench", required=True, choices=sorted(RECIPES), help="benchmark recipe")
    parser.add_argument(
        "--data",
        type=Path,
        nargs="+",
        help="test split: .jsonl/.parquet files or directories (default: none; needed unless --rerun-truncated)",
    )
    parser.add_argument("--dev", type=Path, nargs="*", default=[], help="few-shot examples (ceval, mmlu_pro)")
    parser.add_argument("--out", type=Path, default=Path("eval-mc-results"), help="results directory")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API")
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--attempts", type=int, default=6, help="tries per request (transient errors)")
    parser.add_argument(
        "--sample",
        type=int,
        default=None,
        help="stratified sample of N items, seed 1337 (default: every item)",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="only the first N items (default: every item)"
    )
    parser.add_argument(
        "--rerun-truncated",
        action="store_true",
        help="rerun the finished run's truncated and failed rows with --max-tokens; merge the results",
    )


def _first_model(base_url: str) -> str:
    response = httpx.get(base_url.rstrip("/") + "/models", timeout=30.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _print(summary: dict) -> None:
    shown = {k: v for k, v in summary.items() if k != "per_subject"}
    print(json.dumps(shown, ensure_ascii=False, indent=1, sort_keys=True))


def run(args: argparse.Namespace) -> int:
    files = RunFiles(args.out, args.bench)
    if args.rerun_truncated:
        try:
            summary = rerun_truncated(
                files, args.model, args.max_tokens, args.concurrency, args.timeout, args.attempts
            )
        except RerunError as e:
            print(f"phalanx eval-mc: {e}", file=sys.stderr)
            return 1
        _print(summary)
        return EXIT_INCOMPLETE if summary["incomplete_after_rerun"] else 0

    if not args.data:
        print("phalanx eval-mc: --data is required (unless --rerun-truncated)", file=sys.stderr)
        return 1
    try:
        items = load_paths(args.data)
        dev = load_paths(args.dev) if args.dev else []
    except DatasetError as e:
        print(f"phalanx eval-mc: {e}", file=sys.stderr)
        return 1
    if args.sample is not None:
        items = stratified_sample(items, args.sample)
    if args.limit is not None:
        items = items[: args.limit]
    try:
        model = args.model or _first_model(args.base_url)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"phalanx eval-mc: cannot ask {args.base_url} for its model: {e!r}", file=sys.stderr)
        return 1
    settings = ChatSettings(args.base_url, model, args.max_tokens, args.temperature, args.attempts)
    prompts = build_prompts(RECIPES[args.bench], items, dev)
    summary = run_benchmark(args.bench, items, prompts, settings, files, args.concurrency, args.timeout)
    _print(summary)
    return EXIT_INCOMPLETE if summary["incomplete"] else 0
