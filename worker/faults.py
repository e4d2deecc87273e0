"""Test-only fault injection. Off unless the environment variable PHALANX_TEST_FAULT is set.

Never set PHALANX_TEST_FAULT outside tests. Its value is a comma-separated list of faults
``RANK:POINT[#N]:ACTION[=ARG]``, for example ``1:load:raise``, ``0:command#3:kill``,
``1:reply#2:wrong_rank=0`` or ``0:decode:hang,1:dist_init:hang``.

RANK is a rank number or ``*`` (every rank). ``#N`` fires the fault only the N-th time the point
is reached on that rank (counted from 1); without it the fault fires every time.

Points:
  ``load``, ``dist_init``          startup phases (in the worker's startup code)
  ``ping``, ``prefill``, ``decode``, ``unified``, ``drop``, ``precapture`` (each sweep phase)
                                   inside the command's execution, so ``raise`` is an execution failure
  ``command``                      a command (any kind but Shutdown) as it arrives at the rank
  ``reply``                        a reply to a command as it leaves the rank

Actions, at any point:
  ``raise``   an exception (the worker reports it as a failure; at ``command`` it is raised when
              that command starts executing)
  ``exit``    ``os._exit(17)``: a crash without a reply
  ``kill``    SIGKILL to itself
  ``hang``    sleep forever, as a wedged rank would
  ``slow=S``  sleep S seconds, then go on
Actions at ``reply`` only (they change what travels, see :class:`FaultySocket`):
  ``corrupt``  the frame's bytes are damaged so it no longer decodes
  ``wrong_seq[=D]``    the seq is shifted by D (default -1: a late answer to the previous step)
  ``wrong_rank[=R]``   the reply claims rank R (default: the rank + 100, out of range)
  ``wrong_epoch``      the reply carries another launch's epoch
  ``duplicate``        the reply is sent twice
  ``ack``              an Ack goes out instead of the payload
Actions at ``command`` only:
  ``slot_mismatch``    the command's slots are shuffled (a DropRequest's move is reversed, decode
                       rows trade slots) so the rank's occupancy check fails, as if the coordinator
                       and the rank had diverged
  ``out_of_range``     a Prefill's first chunk starts at position -1, outside the wire limits, as
                       another encoder could send it (the rank refuses the command)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import signal
import time
from typing import Any

import msgspec

from phalanx.config import settings
from phalanx.protocol import PROTOCOL_VERSION, ProtocolError, decode_envelope, decode_reply, encode
from phalanx.protocol.messages import (
    Ack,
    Cancel,
    Challenge,
    Decode,
    DecodeRow,
    DropRequest,
    Envelope,
    Go,
    Prefill,
    ReplyEnvelope,
    Shutdown,
    SlotMove,
    Unified,
)

ENV = settings.TEST_FAULT
EXECUTION_POINTS = ("ping", "prefill", "decode", "unified", "drop", "precapture")
POINTS = ("load", "dist_init", *EXECUTION_POINTS, "command", "reply")
PROCESS_ACTIONS = ("raise", "exit", "kill", "hang", "slow")
REPLY_ACTIONS = ("corrupt", "wrong_seq", "wrong_rank", "wrong_epoch", "duplicate", "ack")
COMMAND_ACTIONS = ("slot_mismatch", "out_of_range")
ACTIONS = PROCESS_ACTIONS + REPLY_ACTIONS + COMMAND_ACTIONS
EXIT_CODE = 17


class InjectedFault(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Fault:
    rank: int | None  # None: every rank
    point: str
    nth: int | None  # None: every time
    action: str
    arg: str | None = None


def _parse_one(item: str) -> Fault:
    try:
        rank_text, point_text, action_text = item.split(":")
    except ValueError:
        raise ValueError(f"{ENV}: fault {item!r} is not RANK:POINT[#N]:ACTION[=ARG]") from None
    point, _, nth = point_text.partition("#")
    action, _, arg = action_text.partition("=")
    allowed = {"reply": PROCESS_ACTIONS + REPLY_ACTIONS, "command": PROCESS_ACTIONS + COMMAND_ACTIONS}
    if point not in POINTS or action not in allowed.get(point, PROCESS_ACTIONS):
        raise ValueError(f"{ENV}: unknown fault {item!r} (points {POINTS}, actions {ACTIONS})")
    if action == "slow" and not arg:
        raise ValueError(f"{ENV}: fault {item!r} needs a duration: slow=SECONDS")
    return Fault(
        None if rank_text == "*" else int(rank_text), point, int(nth) if nth else None, action, arg or None
    )


@functools.lru_cache(maxsize=8)
def parse(spec: str) -> tuple[Fault, ...]:
    return tuple(_parse_one(item) for item in filter(None, (part.strip() for part in spec.split(","))))


_reached: collections.Counter[tuple[int, str]] = collections.Counter()
_armed_raise: dict[int, str] = {}  # rank -> where a ``command:raise`` was armed


def _due(point: str, rank: int) -> list[Fault]:
    """Count one arrival at ``point`` and return the faults that fire on it."""
    spec = settings.injected_faults()
    if not spec:
        return []
    _reached[(rank, point)] += 1
    count = _reached[(rank, point)]
    return [
        f
        for f in parse(spec)
        if f.point == point and f.rank in (None, rank) and (f.nth is None or f.nth == count)
    ]


def _act(fault: Fault, rank: int) -> None:
    where = f"{fault.point}" + (f" #{fault.nth}" if fault.nth else "")
    if fault.action == "raise":
        raise InjectedFault(f"injected fault at {where} on rank {rank}")
    if fault.action == "exit":
        os._exit(EXIT_CODE)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "slow":
        time.sleep(float(fault.arg or 0))
        return
    if fault.action == "hang":
        while True:
            time.sleep(3600)


def fault_point(point: str, rank: int) -> None:
    """Trigger the fault configured for (rank, point), if any."""
    if point in EXECUTION_POINTS and rank in _armed_raise:
        raise InjectedFault(f"injected fault at {_armed_raise.pop(rank)} on rank {rank}")
    for fault in _due(point, rank):
        _act(fault, rank)


def wrap_socket(sock: Any, rank: int) -> Any:
    """The rank's socket, seen through the ``command`` and ``reply`` faults when any are set."""
    spec = settings.injected_faults()
    if not spec or not any(f.point in ("command", "reply") for f in parse(spec)):
        return sock
    return FaultySocket(sock, rank)


# ---------------------------------------------------------------------------------------------
# Faults on the wire
# ---------------------------------------------------------------------------------------------


def _shuffle_slots(envelope: Envelope) -> Envelope:
    body = envelope.body
    if isinstance(body, DropRequest) and body.move is not None:
        move = body.move
        body = msgspec.structs.replace(body, move=SlotMove(move.request_id, move.to_slot, move.from_slot))
    elif isinstance(body, Decode | Unified):
        rows: list[DecodeRow] = body.rows if isinstance(body, Decode) else body.decode
        slots = [row.slot for row in rows]
        shuffled = slots[::-1] if len(set(slots)) > 1 else [slot + 1 for slot in slots]
        rows = [msgspec.structs.replace(row, slot=slot) for row, slot in zip(rows, shuffled, strict=True)]
        body = Decode(rows) if isinstance(body, Decode) else Unified(body.prefill, rows)
    return msgspec.structs.replace(envelope, body=body)


def _out_of_range(envelope: Envelope, frame: bytes) -> bytes:
    if not isinstance(envelope.body, Prefill):
        return frame
    raw = msgspec.to_builtins(envelope, builtin_types=(bytes,))
    raw["body"]["chunks"][0][2] = -1  # PrefillChunk.start
    return msgspec.msgpack.encode(raw)


def _damage(frame: bytes) -> bytes:
    damaged = bytearray(frame)
    damaged[0] = 0xC1  # a byte msgpack never uses: the frame cannot decode
    damaged[len(damaged) // 2] ^= 0xFF
    return bytes(damaged)


def _mutate(fault: Fault, reply: ReplyEnvelope, frames: list[bytes]) -> list[bytes]:
    action, arg = fault.action, fault.arg
    if action == "duplicate":
        return frames + frames
    if action == "corrupt":
        return [_damage(frame) for frame in frames]
    if action == "wrong_seq":
        changed = msgspec.structs.replace(reply, seq=reply.seq + int(arg or -1))
    elif action == "wrong_rank":
        changed = msgspec.structs.replace(reply, rank=int(arg) if arg else reply.rank + 100)
    elif action == "wrong_epoch":
        changed = msgspec.structs.replace(reply, epoch=reply.epoch ^ 0x5A5A5A5A)
    elif action == "ack":
        changed = msgspec.structs.replace(reply, body=Ack())
    else:
        return frames
    return [encode(changed)]


class FaultySocket:
    """Wraps a rank's socket: counts commands in and replies out and applies their faults."""

    def __init__(self, sock: Any, rank: int) -> None:
        self._sock = sock
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def recv(self, timeout_s: float | None) -> bytes | None:
        frame = self._sock.recv(timeout_s)
        if frame is None:
            return None
        try:
            envelope = decode_envelope(frame)
        except ProtocolError:
            return frame
        if envelope.proto != PROTOCOL_VERSION or isinstance(
            envelope.body, Challenge | Go | Cancel | Shutdown
        ):
            return frame
        for fault in _due("command", self._rank):
            if fault.action == "slot_mismatch":
                frame = encode(_shuffle_slots(envelope))
            elif fault.action == "out_of_range":
                frame = _out_of_range(envelope, frame)
            elif fault.action == "raise":
                _armed_raise[self._rank] = f"command #{fault.nth}" if fault.nth else "command"
            else:
                _act(fault, self._rank)
        return frame

    def send(self, payload: bytes) -> None:
        frames = [payload]
        try:
            reply = decode_reply(payload)
        except ProtocolError:
            reply = None
        if reply is not None and reply.seq > 0:
            for fault in _due("reply", self._rank):
                if fault.action in PROCESS_ACTIONS:
                    _act(fault, self._rank)
                else:
                    frames = _mutate(fault, reply, frames)
        for frame in frames:
            self._sock.send(frame)
