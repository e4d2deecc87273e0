"""``phalanx replay``: read a protocol trace recorded with ``--record TRACE``.

phalanx replay show TRACE [--seq A:B] [--rank R]   one readable line per message
phalanx replay stats TRACE                         counts and step latency per command and rank
phalanx replay diff A B                            the first step where two traces diverge
phalanx replay run TRACE --model DIR --tp N        re-run the commands on fresh ranks, compare
"""

from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import dataclass, field

import msgspec
import numpy as np

from phalanx.protocol.messages import (
    FED_TOKEN,
    NO_FEED,
    Cancel,
    Challenge,
    Decode,
    DecodeDone,
    DecodeRow,
    DropAck,
    DropRequest,
    Failed,
    Go,
    Heartbeat,
    Precapture,
    Prefill,
    PrefillChunk,
    PrefillDone,
    Ready,
    Refused,
    TokenResult,
    Unified,
    UnifiedDone,
)
from phalanx.protocol.packing import unpack_ids
from phalanx.protocol.trace import ALL_RANKS, Direction, Entry, Trace, TraceError, read_trace

MAX_ITEMS = 8  # items shown per line before "+N more"

# ---------------------------------------------------------------------------------------------
# One line per message
# ---------------------------------------------------------------------------------------------


def _items(parts: list[str]) -> str:
    shown = " ".join(parts[:MAX_ITEMS])
    return shown + (f" +{len(parts) - MAX_ITEMS} more" if len(parts) > MAX_ITEMS else "")


def _chunk(c: PrefillChunk) -> str:
    end = c.start + len(unpack_ids(c.tokens))
    last = "+last" if c.last else ""
    feeds = f"->s{c.feed_slot}" if c.feed_slot != NO_FEED else ""  # keeps the token for that slot
    return f"r{c.request_id}[{c.start}:{end}]pages={len(unpack_ids(c.page_ids))}{last}{feeds}"


def _row(r: DecodeRow) -> str:
    token = "fed" if r.token == FED_TOKEN else r.token
    return f"r{r.request_id}@s{r.slot}:tok={token},pos={r.position}"


def _result(t: TokenResult) -> str:
    return f"r{t.request_id}->{t.token}" + (f"({t.logprob:.3f})" if t.logprob is not None else "")


def describe_body(body: object) -> str:
    """A short readable summary of a command or reply body."""
    match body:
        case Prefill(chunks=chunks):
            return f"{len(chunks)} chunks: " + _items([_chunk(c) for c in chunks])
        case Decode(rows=rows):
            return f"{len(rows)} rows: " + _items([_row(r) for r in rows])
        case Unified(prefill=chunks, decode=rows):
            return f"{len(chunks)} chunks + {len(rows)} rows: " + _items(
                [_chunk(c) for c in chunks] + [_row(r) for r in rows]
            )
        case DropRequest(request_id=rid, expectation=expectation, move=move):
            moved = f" move r{move.request_id} s{move.from_slot}->s{move.to_slot}" if move else ""
            return f"r{rid} {expectation.value}{moved}"
        case Precapture(phase=phase):
            bucket = getattr(phase, "bucket", None)
            return type(phase).__struct_config__.tag + (f" bucket={bucket}" if bucket is not None else "")
        case Go(capacity=cap, dist_backend=backend):
            return (
                f"{backend} kv_pages={cap.kv_pages} slots={cap.max_slots} batch_tokens={cap.max_batch_tokens}"
            )
        case Cancel(reason=reason):
            return reason
        case Challenge(nonce=nonce):
            return f"nonce={nonce.hex()}"
        case Ready(capacity=cap, device=device, pid=pid, host=host):
            return f"{device} pid={pid}@{host} kv_pages={cap.kv_pages} slots={cap.max_slots}"
        case PrefillDone(results=results) | DecodeDone(results=results):
            return _items([_result(t) for t in results])
        case UnifiedDone(prefill=first, decode=rest):
            return _items([_result(t) for t in first]) + " | " + _items([_result(t) for t in rest])
        case DropAck(existed=existed):
            return f"existed={existed}"
        case Failed(kind=kind, message=message, phase=phase):
            return f"{kind} in {phase}: {message}"
        case Refused(message=message):
            return message
        case Heartbeat(unix_time=t):
            return f"at {t:.3f}"
    return ""


def describe(entry: Entry, start_ns: int) -> str:
    arrow = "->" if entry.direction is Direction.SEND else "<-"
    peer = "all" if entry.rank == ALL_RANKS else str(entry.rank)
    head = f"{entry.index:>7} {(entry.time_ns - start_ns) / 1e9:>11.6f}s {entry.direction.value} {arrow}{peer:<3}"
    if entry.message is None:
        return f"{head} seq=?     undecodable {len(entry.frame)} bytes: {entry.error}"
    return f"{head} seq={entry.seq:<5} {entry.op} {describe_body(entry.message.body)}".rstrip()


# ---------------------------------------------------------------------------------------------
# show / stats
# ---------------------------------------------------------------------------------------------


def _parse_seq_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        if not sep:
            return int(text), int(text)
        return int(low) if low else 0, int(high) if high else sys.maxsize
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq wants A:B, A:, :B or A (integers), got {text!r}") from None


def select(trace: Trace, seq: tuple[int, int] | None, rank: int | None) -> list[Entry]:
    chosen = []
    for entry in trace.entries:
        if seq is not None and (entry.seq is None or not seq[0] <= entry.seq <= seq[1]):
            continue
        if rank is not None and entry.rank not in (rank, ALL_RANKS):
            continue
        chosen.append(entry)
    return chosen


def _start_ns(trace: Trace) -> int:
    return trace.entries[0].time_ns if trace.entries else 0


def show(trace: Trace, seq: tuple[int, int] | None = None, rank: int | None = None) -> list[str]:
    start = _start_ns(trace)
    lines = [describe(e, start) for e in select(trace, seq, rank)]
    if trace.torn_bytes:
        lines.append(f"(torn tail: the last {trace.torn_bytes} bytes hold an incomplete record)")
    return lines


def _percentiles_ms(samples_ns: list[int]) -> str:
    ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"n={len(ms):<6} p50={p50:9.3f}ms p90={p90:9.3f}ms p99={p99:9.3f}ms max={ms.max():9.3f}ms"


def stats(trace: Trace) -> list[str]:
    h = trace.header
    span = (trace.entries[-1].time_ns - trace.entries[0].time_ns) / 1e9 if trace.entries else 0.0
    lines = [
        f"trace epoch={h.epoch} world_size={h.world_size} messages={len(trace.entries)} span={span:.3f}s",
        "meta " + " ".join(f"{k}={v}" for k, v in sorted(h.meta.items())),
    ]
    commands = collections.Counter(e.op for e in trace.sends())
    replies = collections.Counter((e.rank, e.op) for e in trace.replies())
    lines.append("commands  " + " ".join(f"{op}={n}" for op, n in sorted(commands.items())))
    for rank in sorted({r for r, _ in replies}):
        counts = " ".join(f"{op}={n}" for (r, op), n in sorted(replies.items()) if r == rank)
        lines.append(f"replies rank {rank:<3} {counts}")

    sent_at: dict[tuple[int, int], int] = {}  # (seq, rank or ALL_RANKS) -> send time
    kind_of: dict[int, str] = {}
    first_sent: dict[int, int] = {}
    for e in trace.sends():
        if e.seq is not None and e.seq > 0:
            sent_at.setdefault((e.seq, e.rank), e.time_ns)
            first_sent.setdefault(e.seq, e.time_ns)
            kind_of.setdefault(e.seq, e.op)
    per_rank: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    last_reply: dict[int, int] = {}
    answered: dict[int, set[int]] = collections.defaultdict(set)
    for e in trace.replies():
        if e.seq not in kind_of:
            continue
        sent = sent_at.get((e.seq, e.rank), sent_at.get((e.seq, ALL_RANKS)))
        if sent is None or e.rank in answered[e.seq]:
            continue
        answered[e.seq].add(e.rank)
        per_rank[(kind_of[e.seq], e.rank)].append(e.time_ns - sent)
        last_reply[e.seq] = max(last_reply.get(e.seq, 0), e.time_ns)
    lines.append("step latency (send -> reply), per command kind and rank:")
    for (op, rank), samples in sorted(per_rank.items()):
        lines.append(f"  {op:<10} rank {rank:<3} {_percentiles_ms(samples)}")
    whole: dict[str, list[int]] = collections.defaultdict(list)
    for seq, op in kind_of.items():
        if len(answered[seq]) == h.world_size:
            whole[op].append(last_reply[seq] - first_sent[seq])
    lines.append("step latency (send -> last reply), per command kind:")
    lines += [f"  {op:<10} {_percentiles_ms(samples)}" for op, samples in sorted(whole.items())]
    unanswered = sorted(s for s in kind_of if len(answered[s]) < h.world_size)
    undecodable = sum(1 for e in trace.entries if e.message is None)
    lines.append(f"incomplete steps={len(unanswered)}{f' (first seq {unanswered[0]})' if unanswered else ''}")
    lines.append(f"undecodable frames={undecodable} torn_bytes={trace.torn_bytes}")
    return lines


# ---------------------------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------------------------


def _comparable(body: object) -> object:
    """What must be equal between two runs: not pids, hosts, rendezvous ports, nonces or tracebacks."""
    if isinstance(body, Go):
        return ("go", body.capacity, body.dist_backend)
    if isinstance(body, Ready):
        return ("ready", body.capacity, body.device)
    if isinstance(body, Challenge):  # a fresh nonce every launch
        return ("challenge",)
    if isinstance(body, Failed):
        return ("failed", body.kind, body.phase, body.message)
    return body


def _comparables(values: list[object]) -> list[object]:
    return [_comparable(v) for v in values]


@dataclass
class Step:
    """One sequence number: the distinct command bodies sent, and every rank's reply bodies
    (an undecodable frame appears as ``("undecodable", frame)``)."""

    seq: int | None
    first: Entry
    commands: list[object] = field(default_factory=list)
    replies: dict[int, list[object]] = field(default_factory=lambda: collections.defaultdict(list))


def steps(trace: Trace) -> list[Step]:
    by_seq: dict[int | None, Step] = {}
    order: list[Step] = []
    for e in trace.entries:
        if e.message is not None and isinstance(e.message.body, Heartbeat):
            continue
        key = e.seq if e.message is not None else ("undecodable", e.index)
        step = by_seq.get(key)
        if step is None:
            step = by_seq[key] = Step(e.seq, e)
            order.append(step)
        value = e.message.body if e.message is not None else ("undecodable", e.frame)
        if e.direction is Direction.SEND:
            if value not in step.commands:
                step.commands.append(value)
        else:
            step.replies[e.rank].append(value)
    return order


def _brief(value: object) -> str:
    if isinstance(value, msgspec.Struct):
        return f"{type(value).__struct_config__.tag} {describe_body(value)}".rstrip()
    return repr(value)[:200]


def diff(a: Trace, b: Trace) -> list[str]:
    """Empty when the traces agree; otherwise lines describing the first divergence."""
    steps_a, steps_b = steps(a), steps(b)
    for index, (x, y) in enumerate(zip(steps_a, steps_b, strict=False)):
        where = f"first divergence at step {index} (seq {x.seq} in A, seq {y.seq} in B)"
        if x.seq != y.seq or _comparables(x.commands) != _comparables(y.commands):
            return [where + ": the commands differ", *_side("A", x.commands), *_side("B", y.commands)]
        for rank in sorted(set(x.replies) | set(y.replies)):
            if _comparables(x.replies.get(rank, [])) != _comparables(y.replies.get(rank, [])):
                return [
                    where + f": rank {rank} replied differently",
                    *_side("A", x.replies.get(rank, [])),
                    *_side("B", y.replies.get(rank, [])),
                ]
    if len(steps_a) != len(steps_b):
        longer, name = (steps_a, "A") if len(steps_a) > len(steps_b) else (steps_b, "B")
        extra = longer[min(len(steps_a), len(steps_b))]
        return [
            f"first divergence at step {min(len(steps_a), len(steps_b))}: only {name} continues "
            f"({len(steps_a)} steps in A, {len(steps_b)} in B)",
            *_side(name, extra.commands or [v for vs in extra.replies.values() for v in vs]),
        ]
    return []


def _side(name: str, values: list[object]) -> list[str]:
    return [f"  {name}: {_brief(v)}" for v in values] or [f"  {name}: (nothing)"]


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


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
        else:
            from phalanx.tools.replay_run import replay_against_fresh_ranks

            return replay_against_fresh_ranks(args)
    except (TraceError, OSError) as exc:
        print(f"phalanx replay: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0
