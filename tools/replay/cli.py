"""``phalanx replay``: read a protocol trace recorded with ``--record TRACE``.

phalanx replay show TRACE [--seq A:B] [--rank R]   one readable line per message
phalanx replay stats TRACE                         counts and step latency per command kind and rank
phalanx replay diff A B                            the first step where two traces diverge
phalanx replay run TRACE --model DIR --tp N        re-run the commands on fresh ranks, compare
"""

from __future__ import annotations

import argparse
import sys

from phalanx.protocol.trace import TraceError, read_trace
from phalanx.tools.replay.diff import diff
from phalanx.tools.replay.show import show
from phalanx.tools.replay.stats import stats


def _parse_seq_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        if not sep:
            return int(text), int(text)
        return int(low) if low else 0, int(high) if high else sys.maxsize
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq wants A:B, A:, :B or A (integers), got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    trace_help = "a trace written by --record"
    p = actions.add_parser("show", help="one readable line per message")
    p.add_argument("trace", help=trace_help)
    p.add_argument(
        "--seq", type=_parse_seq_range, help="only seq A through B (A:B, A:, :B or A; default: all)"
    )
    p.add_argument("--rank", type=int, help="only messages to or from this rank (default: every rank)")
    p = actions.add_parser("stats", help="counts and step-latency percentiles per command kind and rank")
    p.add_argument("trace", help=trace_help)
    p = actions.add_parser("diff", help="the first step where two traces diverge")
    p.add_argument("a", help="the first trace")
    p.add_argument("b", help="the second trace")
    p = actions.add_parser("run", help="replay the commands against fresh ranks and compare every reply")
    p.add_argument("trace", help=trace_help)
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks run")
    p.add_argument("--record", help="record the replay itself to this trace (default: none)")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds one step may take")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "show":
            lines = show(read_trace(args.trace), args.seq, args.rank)
        elif args.action == "stats":
            lines = stats(read_trace(args.trace))
        elif args.action == "diff":
            lines = diff(read_trace(args.a), read_trace(args.b))
            print("\n".join(lines) if lines else "the traces agree")
            return 1 if lines else 0
        else:  # imported here: only run needs the executor
            from phalanx.tools.replay.run import replay_against_fresh_ranks

            return replay_against_fresh_ranks(args)
    except (TraceError, OSError) as exc:
        print(f"phalanx replay: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0
