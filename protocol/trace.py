"""Protocol traces: every envelope the coordinator sent and every reply it received.

A trace file is the magic line ``PHXTRACE1\\n`` followed by records, each a little-endian uint32
length and that many bytes of msgpack. The first record is a :class:`TraceHeader`; every other
record is a :class:`TraceMessage` holding the frame exactly as it crossed the wire (the codec's
bytes, before any TCP authentication wrapper), so a trace also keeps frames that did not decode.

Records are appended with one unbuffered ``write`` each: a coordinator killed mid-write leaves at
most one torn record at the end, which the reader reports and skips. Damage anywhere else is an
error, because a record that follows garbage cannot be trusted.
"""

from __future__ import annotations

import enum
import os
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from phalanx.protocol.codec import decode_envelope, decode_reply
from phalanx.protocol.errors import ProtocolError
from phalanx.protocol.messages import Envelope, ReplyEnvelope

MAGIC = b"PHXTRACE1\n"
TRACE_VERSION = 1
ALL_RANKS = -1  # a frame sent to every rank, or a reply whose rank is read from the frame

_LENGTH = struct.Struct("<I")
MAX_RECORD_BYTES = 1 << 30

MetaValue = str | int | float | bool | None


class Direction(enum.Enum):
    SEND = "send"
    RECV = "recv"


class TraceHeader(msgspec.Struct, frozen=True, tag="header", tag_field="kind"):
    """Who recorded the trace: the launch epoch, world size, and the launch settings in ``meta``
    (model directory, device, capacity limits...) so ``phalanx replay run`` can start alike."""

    version: int
    created_unix: float
    epoch: int
    world_size: int
    meta: dict[str, MetaValue] = {}


class TraceMessage(msgspec.Struct, frozen=True, tag="msg", tag_field="kind"):
    """One frame. ``time_ns`` is ``time.time_ns()`` in the coordinator when the frame was handed
    to (or taken from) the socket; ``rank`` is the destination of a send, the source of a reply."""

    time_ns: int
    direction: Direction
    rank: int
    frame: bytes


TraceRecord = TraceHeader | TraceMessage

_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(TraceRecord)


class TraceError(Exception):
    """A trace file that cannot be read (not a trace, or damaged before its last record)."""


class TraceWriter:
    """Appends records to a trace file. Safe to call from several threads."""

    def __init__(self, path: str | os.PathLike[str], header: TraceHeader) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115 - lives as long as the writer
        self._lock = threading.Lock()
        self.records = 0
        self._file.write(MAGIC)
        self._append(header)

    def _append(self, record: TraceRecord) -> None:
        payload = _record_encoder.encode(record)
        with self._lock:
            if self._file.closed:
                raise TraceError(f"trace {self.path} is closed")
            self._file.write(_LENGTH.pack(len(payload)) + payload)
            self.records += 1

    def sent(self, frame: bytes, rank: int = ALL_RANKS) -> None:
        """Record a command frame handed to the socket of ``rank`` (ALL_RANKS: to every rank)."""
        self._append(TraceMessage(time.time_ns(), Direction.SEND, rank, bytes(frame)))

    def sent_to(self, frame: bytes, ranks: list[int] | None) -> None:
        """Record one frame sent to ``ranks`` (None: to every rank, kept as one record)."""
        for rank in [ALL_RANKS] if ranks is None else ranks:
            self.sent(frame, rank)

    def received(self, frame: bytes, rank: int = ALL_RANKS) -> None:
        """Record a reply frame as it came off the socket (ALL_RANKS: rank read from the frame)."""
        self._append(TraceMessage(time.time_ns(), Direction.RECV, rank, bytes(frame)))

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trace(
    path: str | os.PathLike[str],
    *,
    epoch: int,
    world_size: int,
    meta: Mapping[str, object] | None = None,
) -> TraceWriter:
    """Start a new trace (truncating ``path``) for one launch. ``meta`` keeps its scalar values
    (a launch config's fields); anything else is written as its ``str``."""
    kept = {
        str(k): v if v is None or isinstance(v, str | int | float | bool) else str(v)
        for k, v in (meta or {}).items()
    }
    header = TraceHeader(TRACE_VERSION, time.time(), epoch, world_size, kept)
    return TraceWriter(path, header)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A trace message with its frame decoded where possible.

    ``message`` is the Envelope (sends) or ReplyEnvelope (replies), or None when the frame did
    not decode, in which case ``error`` says why. ``rank`` is the recorded rank, or for a reply
    recorded with ALL_RANKS, the rank written in the frame.
    """

    index: int
    time_ns: int
    direction: Direction
    rank: int
    frame: bytes
    message: Envelope | ReplyEnvelope | None
    error: str | None = None

    @property
    def seq(self) -> int | None:
        return None if self.message is None else self.message.seq

    @property
    def op(self) -> str:
        """The body's tag ("decode", "decode_done", ...) or "undecodable"."""
        if self.message is None:
            return "undecodable"
        return type(self.message.body).__struct_config__.tag


@dataclass
class Trace:
    header: TraceHeader
    entries: list[Entry] = field(default_factory=list)
    torn_bytes: int = 0  # size of an incomplete last record that was skipped

    def sends(self) -> list[Entry]:
        return [e for e in self.entries if e.direction is Direction.SEND]

    def replies(self) -> list[Entry]:
        return [e for e in self.entries if e.direction is Direction.RECV]


def iter_records(path: str | os.PathLike[str]) -> Iterator[TraceRecord | int]:
    """Yield each record; a torn tail ends the iteration by yielding its size in bytes (an int)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise TraceError(f"{path} is not a phalanx trace (missing {MAGIC!r} magic)")
    offset, index = len(MAGIC), 0
    while offset < len(data):
        if len(data) - offset < _LENGTH.size:
            yield len(data) - offset
            return
        (length,) = _LENGTH.unpack_from(data, offset)
        if length > MAX_RECORD_BYTES:
            raise TraceError(f"{path}: record {index} at byte {offset} claims {length} bytes")
        end = offset + _LENGTH.size + length
        if end > len(data):
            yield len(data) - offset
            return
        try:
            yield _record_decoder.decode(data[offset + _LENGTH.size : end])
        except msgspec.DecodeError as exc:
            raise TraceError(f"{path}: record {index} at byte {offset} is damaged: {exc}") from None
        offset, index = end, index + 1


def _decode_entry(index: int, record: TraceMessage) -> Entry:
    try:
        if record.direction is Direction.SEND:
            message: Envelope | ReplyEnvelope = decode_envelope(record.frame)
        else:
            message = decode_reply(record.frame)
    except ProtocolError as exc:
        return Entry(index, record.time_ns, record.direction, record.rank, record.frame, None, str(exc))
    rank = record.rank
    if rank == ALL_RANKS and isinstance(message, ReplyEnvelope):
        rank = message.rank
    return Entry(index, record.time_ns, record.direction, rank, record.frame, message)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a whole trace, decoding every frame. A torn last record is skipped and measured."""
    trace: Trace | None = None
    for record in iter_records(path):
        if isinstance(record, int):
            if trace is None:
                raise TraceError(f"{path}: the header record is incomplete")
            trace.torn_bytes = record
            break
        if isinstance(record, TraceHeader):
            if trace is not None:
                raise TraceError(f"{path}: a second header at message {len(trace.entries)}")
            if record.version != TRACE_VERSION:
                raise TraceError(f"{path}: trace version {record.version}, expected {TRACE_VERSION}")
            trace = Trace(record)
            continue
        if trace is None:
            raise TraceError(f"{path}: the first record is not a header")
        trace.entries.append(_decode_entry(len(trace.entries), record))
    if trace is None:
        raise TraceError(f"{path}: the trace has no header")
    return trace
