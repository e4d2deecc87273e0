"""``phalanx replay stats``: message counts, step-latency percentiles per command kind and rank,
and the cadence of back-to-back decode steps (whether the ranks were kept fed)."""

from __future__ import annotations

import collections

import numpy as np

from phalanx.protocol.trace import ALL_RANKS, Trace


def _percentiles_ms(samples_ns: list[int], low_tail: bool = False) -> str:
    """n, p50, p90, p99 and max; with ``low_tail``, the tail that matters is the low one: p1, p10,
    p50 and min."""
    ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
    if low_tail:
        p1, p10, p50 = np.percentile(ms, [1, 10, 50])
        return f"n={len(ms):<6} p50={p50:9.3f}ms p10={p10:9.3f}ms p1={p1:9.3f}ms min={ms.min():9.3f}ms"
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"n={len(ms):<6} p50={p50:9.3f}ms p90={p90:9.3f}ms p99={p99:9.3f}ms max={ms.max():9.3f}ms"


def _decode_cadence(
    kind_of: dict[int, str], first_sent: dict[int, int], done_at: dict[int, int]
) -> list[str]:
    """Back-to-back decode steps (seq N - 1 and N both decode, both answered by every rank): how
    often one was sent and answered, and step N's lead, the time from its send to step N - 1's
    last reply. A pipelined coordinator that keeps the ranks fed has a positive lead; a negative
    one is time the ranks spent waiting for the next command."""
    sends, replies, leads = [], [], []
    for seq, op in kind_of.items():
        before = seq - 1
        if op != "decode" or kind_of.get(before) != "decode" or seq not in done_at or before not in done_at:
            continue
        sends.append(first_sent[seq] - first_sent[before])
        replies.append(done_at[seq] - done_at[before])
        leads.append(done_at[before] - first_sent[seq])
    if not sends:
        return []
    return [
        "decode cadence (back-to-back decode steps):",
        f"  send interval  {_percentiles_ms(sends)}",
        f"  reply interval {_percentiles_ms(replies)}",
        f"  lead (sent before the previous step's reply) {_percentiles_ms(leads, low_tail=True)}",
    ]


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
    done_at = {seq: last_reply[seq] for seq in kind_of if len(answered[seq]) == h.world_size}
    whole: dict[str, list[int]] = collections.defaultdict(list)
    for seq, done in done_at.items():
        whole[kind_of[seq]].append(done - first_sent[seq])
    lines.append("step latency (send -> last reply), per command kind:")
    lines += [f"  {op:<10} {_percentiles_ms(samples)}" for op, samples in sorted(whole.items())]
    lines += _decode_cadence(kind_of, first_sent, done_at)
    unanswered = sorted(s for s in kind_of if len(answered[s]) < h.world_size)
    undecodable = sum(1 for e in trace.entries if e.message is None)
    lines.append(f"incomplete steps={len(unanswered)}{f' (first seq {unanswered[0]})' if unanswered else ''}")
    lines.append(f"undecodable frames={undecodable} torn_bytes={trace.torn_bytes}")
    return lines
