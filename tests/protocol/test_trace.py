"""Trace files: round trip, decoding of every frame, torn tails tolerated, damage refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Decode,
    DecodeDone,
    DecodeRow,
    Envelope,
    ReplyEnvelope,
    TokenResult,
    encode,
    pack_ids,
)
from phalanx.protocol.trace import ALL_RANKS, MAGIC, Direction, TraceError, open_trace, read_trace

EPOCH = 77


def _decode_step(seq: int) -> tuple[bytes, bytes, bytes]:
    row = DecodeRow(request_id=5, slot=0, token=11, position=3, page_ids=pack_ids([0]))
    command = encode(Envelope(PROTOCOL_VERSION, EPOCH, seq, Decode([row])))
    primary = encode(ReplyEnvelope(PROTOCOL_VERSION, EPOCH, 0, seq, DecodeDone([TokenResult(5, 42)])))
    ack = encode(ReplyEnvelope(PROTOCOL_VERSION, EPOCH, 1, seq, Ack()))
    return command, primary, ack


def _write(path: Path, steps: int) -> None:
    with open_trace(path, epoch=EPOCH, world_size=2, meta={"model": "tiny", "tp": 2}) as writer:
        for seq in range(1, steps + 1):
            command, primary, ack = _decode_step(seq)
            writer.sent(command)
            writer.received(ack)  # rank read from the frame
            writer.received(primary, rank=0)


def test_round_trip_keeps_order_direction_rank_and_frames(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    _write(path, steps=3)
    trace = read_trace(path)
    assert trace.header.epoch == EPOCH and trace.header.world_size == 2
    assert trace.header.meta == {"model": "tiny", "tp": 2}
    assert trace.torn_bytes == 0
    assert [(e.direction, e.rank, e.seq, e.op) for e in trace.entries[:3]] == [
        (Direction.SEND, ALL_RANKS, 1, "decode"),
        (Direction.RECV, 1, 1, "ack"),
        (Direction.RECV, 0, 1, "decode_done"),
    ]
    assert len(trace.sends()) == 3 and len(trace.replies()) == 6
    times = [e.time_ns for e in trace.entries]
    assert times == sorted(times)
    assert trace.entries[2].message.body.results[0].token == 42
    assert trace.entries[0].frame == _decode_step(1)[0]


def test_undecodable_frame_is_kept_with_its_error(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    with open_trace(path, epoch=EPOCH, world_size=1) as writer:
        writer.received(b"\xc1garbage", rank=0)
    (entry,) = read_trace(path).entries
    assert entry.message is None and entry.op == "undecodable" and entry.rank == 0
    assert entry.error.startswith("protocol error (undecodable): reply frame")


@pytest.mark.parametrize("cut", [1, 3, 4, 10])
def test_torn_tail_is_skipped_and_measured(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "t.trace"
    _write(path, steps=2)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    trace = read_trace(path)
    assert len(trace.entries) == 5  # the last reply is torn
    assert trace.torn_bytes > 0


def test_damage_before_the_tail_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    _write(path, steps=2)
    data = bytearray(path.read_bytes())
    header_length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    first_message = len(MAGIC) + 4 + header_length
    data[first_message + 4] = 0xC1  # msgpack "never used" byte where the record starts
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match=r"record 1 at byte \d+ is damaged"):
        read_trace(path)


def test_not_a_trace_and_missing_header_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_bytes(b"hello")
    with pytest.raises(TraceError, match="is not a phalanx trace"):
        read_trace(path)
    path.write_bytes(MAGIC + b"\x05\x00")
    with pytest.raises(TraceError, match="header record is incomplete"):
        read_trace(path)


def test_writer_refuses_after_close(tmp_path: Path) -> None:
    writer = open_trace(tmp_path / "t.trace", epoch=1, world_size=1)
    writer.close()
    with pytest.raises(TraceError, match="is closed"):
        writer.sent(b"x")
