"""``phalanx replay diff``: the steps of a trace (one sequence number: the commands sent and every
rank's replies), and the first step where two traces diverge."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import msgspec

from phalanx.protocol.messages import Challenge, Failed, Go, Heartbeat, Ready
from phalanx.protocol.trace import Direction, Entry, Trace
from phalanx.tools.replay.show import describe_body


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
