"""``phalanx replay show``: one readable line per message of a protocol trace, and the short
summary of a command or reply body that every replay view prints."""

from __future__ import annotations

from phalanx.protocol.codec import unpack_ids
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
    RequestRejected,
    TokenResult,
    Unified,
    UnifiedDone,
)
from phalanx.protocol.trace import ALL_RANKS, Direction, Entry, Trace

MAX_ITEMS = 8  # items shown per line before "+N more"


def _items(parts: list[str]) -> str:
    shown = " ".join(parts[:MAX_ITEMS])
    return shown + (f" +{len(parts) - MAX_ITEMS} more" if len(parts) > MAX_ITEMS else "")


def _chunk(c: PrefillChunk) -> str:
    end = c.start + len(unpack_ids(c.tokens))
    last = "+last" if c.last else ""
    feeds = f"->s{c.feed_slot}" if c.feed_slot != NO_FEED else ""  # keeps the token for that slot
    # prefix-cache snapshots: restored from (snapshot slot, key) before, saved at positions after
    restore = f"<snap{c.restore.slot}#{c.restore.key}" if c.restore is not None else ""
    saves = "".join(f">snap{s.slot}#{s.key}@{s.position}" for s in c.save)
    return f"r{c.request_id}[{c.start}:{end}]pages={len(unpack_ids(c.page_ids))}{last}{feeds}{restore}{saves}"


def _row(r: DecodeRow) -> str:
    token = "fed" if r.token == FED_TOKEN else r.token
    return f"r{r.request_id}@s{r.slot}:tok={token},pos={r.position}"


def _result(t: TokenResult) -> str:
    return f"r{t.request_id}->{t.token}" + (f"({t.logprob:.3f})" if t.logprob is not None else "")


def _rejected(rejected: list[RequestRejected]) -> str:
    return "".join(f" r{entry.request_id} rejected: {entry.reason}" for entry in rejected)


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
        case PrefillDone(results=results, rejected=rejected) | DecodeDone(results=results, rejected=rejected):
            return _items([_result(t) for t in results]) + _rejected(rejected)
        case UnifiedDone(prefill=first, decode=rest, rejected=rejected):
            both = _items([_result(t) for t in first]) + " | " + _items([_result(t) for t in rest])
            return both + _rejected(rejected)
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
