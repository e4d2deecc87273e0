"""``phalanx make-tiny-model DIR``: write a tiny random Qwen3.5 checkpoint and tokenizer."""

from __future__ import annotations

import argparse
import sys

import structlog

log = structlog.get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created if missing)")
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", help="lm_head shares embed_tokens")
    tie.add_argument("--untied", dest="tied", action="store_false", help="separate lm_head (default)")
    parser.set_defaults(tied=False)
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from phalanx.models.tiny import build_tiny_model

    try:
        out = build_tiny_model(args.dir, tied=args.tied, seed=args.seed)
    except OSError as e:
        print(f"phalanx make-tiny-model: error: cannot write {args.dir}: {e}", file=sys.stderr)
        return 2
    log.info("tiny model written", dir=str(out), tied=args.tied, seed=args.seed)
    return 0
