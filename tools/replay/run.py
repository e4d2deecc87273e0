"""``phalanx replay run``: send a trace's commands to fresh ranks and check every reply matches.

The coordinator owns every decision (request ids, pages, slots) and the commands carry them, so a
recorded command stream replays on a new launch as it is. Each recorded step is replayed through
the executor's public calls and its outcome (rank 0's tokens and logprobs and the requests it
rejected, or the failure that poisoned the replica) is compared with what was recorded. On CPU the tokens are equal.

Startup messages (seq 0), the gate's first Ping and the pre-capture sweep are not replayed: the
new launch runs its own.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from phalanx.executor.errors import ExecutorError
from phalanx.executor.gate import FIRST_PING_SEQ
from phalanx.executor.launcher import ExecutorConfig, launch_executor
from phalanx.executor.runtime import Executor
from phalanx.protocol.messages import (
    Capacity,
    Decode,
    DecodeDone,
    DropRequest,
    Failed,
    Go,
    Ping,
    Precapture,
    Prefill,
    PrefillDone,
    Shutdown,
    TokenResult,
    Unified,
    UnifiedDone,
)
from phalanx.protocol.trace import Direction, Trace, read_trace
from phalanx.tools.replay.diff import Step, steps
from phalanx.tools.replay.show import describe_body

LOGPROB_TOLERANCE = 1e-4


@dataclass
class Outcome:
    """What one step produced: rank 0's token results and the ids of the requests it rejected,
    or a failure text (None: nothing known)."""

    results: list[TokenResult] | None = None
    failure: str | None = None
    rejected: list[int] = field(default_factory=list)


def recorded_capacity(trace: Trace) -> Capacity | None:
    for entry in trace.entries:
        if (
            entry.direction is Direction.SEND
            and entry.message is not None
            and isinstance(entry.message.body, Go)
        ):
            return entry.message.body.capacity
    return None


def _results(body: object) -> list[TokenResult] | None:
    if isinstance(body, PrefillDone | DecodeDone):
        return list(body.results)
    if isinstance(body, UnifiedDone):
        return list(body.prefill) + list(body.decode)
    return None


def _rejected(body: object) -> list[int]:
    if isinstance(body, PrefillDone | DecodeDone | UnifiedDone):
        return [entry.request_id for entry in body.rejected]
    return []


def recorded_outcome(step: Step) -> Outcome:
    """The first Failed any rank sent, else rank 0's payload; nothing when rank 0 never replied."""
    for replies in step.replies.values():
        for reply in replies:
            if isinstance(reply, Failed):
                return Outcome(failure=f"{reply.message} ({reply.phase})")
    for reply in step.replies.get(0, []):
        results = _results(reply)
        return Outcome(results=[] if results is None else results, rejected=_rejected(reply))
    return Outcome()


def execute(ex: Executor, command: object) -> Outcome:
    if not isinstance(command, Prefill | Decode | Unified | DropRequest | Ping):
        raise ValueError(f"cannot replay {type(command).__name__}")
    try:
        reply = ex.call(command)
    except ExecutorError as exc:
        return Outcome(failure=str(exc))
    return Outcome(results=_results(reply) or [], rejected=_rejected(reply))


def _same_results(a: list[TokenResult], b: list[TokenResult]) -> bool:
    if [(t.request_id, t.token, t.top_ids) for t in a] != [(t.request_id, t.token, t.top_ids) for t in b]:
        return False
    for x, y in zip(a, b, strict=True):
        pairs = [(x.logprob, y.logprob)] + list(zip(x.top_logprobs or [], y.top_logprobs or [], strict=False))
        for p, q in pairs:
            if (p is None) != (q is None) or (
                p is not None and not math.isclose(p, q, abs_tol=LOGPROB_TOLERANCE)
            ):
                return False
    return True


def compare(recorded: Outcome, replayed: Outcome) -> str | None:
    """None when the replay agrees with the recording (or nothing was recorded); else the difference."""
    if recorded.results is None and recorded.failure is None:
        return None
    if (recorded.failure is None) != (replayed.failure is None):
        return f"recorded {recorded.failure or 'success'}, replayed {replayed.failure or 'success'}"
    if recorded.failure is not None:
        return None  # both failed: the failure reproduces (texts name seqs that may differ)
    if recorded.rejected != replayed.rejected:
        return f"recorded rejected requests {recorded.rejected}, replayed {replayed.rejected}"
    if not _same_results(recorded.results or [], replayed.results or []):
        before = describe_body(DecodeDone(recorded.results or []))
        after = describe_body(DecodeDone(replayed.results or []))
        return f"recorded {before}, replayed {after}"
    return None


def _replayable(step: Step) -> object | None:
    if step.seq is None or step.seq == 0 or not step.commands:
        return None
    command = step.commands[0]
    if isinstance(command, Precapture | Shutdown) or (
        isinstance(command, Ping) and step.seq == FIRST_PING_SEQ
    ):
        return None
    return command


def replay_config(trace: Trace, args: argparse.Namespace) -> ExecutorConfig:
    """Fresh ranks as the recorded ones were: the capacity Go gave them (the launch settings of an
    older trace without one), and as many snapshot slots, which the trace's restores and saves name."""
    capacity = recorded_capacity(trace)
    meta = trace.header.meta
    limits = {
        name: int(getattr(capacity, name) if capacity is not None else meta[name])
        for name in ("kv_pages", "page_size", "max_slots", "max_batch_tokens")
        if capacity is not None or name in meta
    }
    snapshots: dict[str, int | bool] = {}
    if capacity is not None:
        slots = capacity.snapshot_slots
        snapshots = {"prefix_snapshots": slots} if slots else {"prefix_cache": False}
    return ExecutorConfig(
        model_dir=args.model,
        tp=args.tp,
        device=args.device,
        step_timeout=args.step_timeout,
        record=args.record,
        **limits,
        **snapshots,
    )


def replay_against_fresh_ranks(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    config = replay_config(trace, args)
    replayed_steps = 0
    ex = launch_executor(config)
    try:
        for step in steps(trace):
            command = _replayable(step)
            if command is None:
                continue
            outcome = execute(ex, command)
            replayed_steps += 1
            problem = compare(recorded_outcome(step), outcome)
            if problem is not None:
                op = type(command).__struct_config__.tag
                print(f"replay diverges at seq {step.seq} ({op} {describe_body(command)}): {problem}")
                return 1
            if outcome.failure is not None:
                print(f"seq {step.seq}: the recorded failure reproduces: {outcome.failure}")
                break
    finally:
        ex.shutdown()
    print(f"replayed {replayed_steps} commands at tp={args.tp}: every reply matches")
    return 0
