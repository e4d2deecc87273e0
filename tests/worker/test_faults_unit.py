"""The fault-injection facility itself: parsing, counting, and what each wire fault does to a frame.

The faults driven through real ranks are in ``test_faults_runtime.py``.
"""

from __future__ import annotations

import pytest

from phalanx.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Decode,
    DecodeDone,
    DecodeRow,
    DropRequest,
    Envelope,
    Expectation,
    ProtocolError,
    ReplyEnvelope,
    Shutdown,
    SlotMove,
    TokenResult,
    decode_envelope,
    decode_reply,
    encode,
    pack_ids,
)
from phalanx.worker import faults


class _Wire:
    """A test double for the rank's socket: queued commands in, sent frames recorded."""

    def __init__(self, incoming: list[bytes]) -> None:
        self.incoming = list(incoming)
        self.sent: list[bytes] = []

    def recv(self, timeout_s: float | None) -> bytes | None:
        return self.incoming.pop(0) if self.incoming else None

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    faults._reached.clear()
    faults._armed_raise.clear()


def _command(seq: int, body: object) -> bytes:
    return encode(Envelope(PROTOCOL_VERSION, 5, seq, body))


def _reply(seq: int, rank: int = 0) -> bytes:
    return encode(ReplyEnvelope(PROTOCOL_VERSION, 5, rank, seq, DecodeDone([TokenResult(1, 2)])))


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    wire = _Wire([])
    assert faults.wrap_socket(wire, 0) is wire
    faults.fault_point("decode", 0)  # nothing happens
    assert not faults._reached


def test_parse_and_refuse_unknown() -> None:
    assert faults.parse("1:load:raise, *:reply#3:wrong_rank=0,0:decode:slow=0.5") == (
        faults.Fault(1, "load", None, "raise"),
        faults.Fault(None, "reply", 3, "wrong_rank", "0"),
        faults.Fault(0, "decode", None, "slow", "0.5"),
    )
    for bad in (
        "1:nowhere:raise",
        "1:load:explode",
        "1:load:corrupt",
        "1:decode:slot_mismatch",
        "1:load",
        "0:x:slow",
    ):
        with pytest.raises(ValueError, match=faults.ENV):
            faults.parse(bad)


def test_nth_arrival_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "1:decode#2:raise")
    faults.fault_point("decode", 0)  # another rank
    faults.fault_point("decode", 1)
    with pytest.raises(faults.InjectedFault, match="injected fault at decode #2 on rank 1"):
        faults.fault_point("decode", 1)
    faults.fault_point("decode", 1)


def test_command_raise_fires_inside_that_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "0:command#2:raise")
    wire = faults.wrap_socket(_Wire([_command(1, Decode([])), _command(2, Decode([]))]), 0)
    wire.recv(None)
    faults.fault_point("decode", 0)
    wire.recv(None)
    with pytest.raises(faults.InjectedFault, match="injected fault at command #2 on rank 0"):
        faults.fault_point("decode", 0)


def test_shutdown_and_startup_replies_are_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "0:command#1:slot_mismatch,0:reply#1:duplicate")
    shutdown = _command(3, Shutdown())
    wire = _Wire([shutdown])
    sock = faults.wrap_socket(wire, 0)
    assert sock.recv(None) == shutdown
    sock.send(_reply(0))  # seq 0: a startup message
    sock.send(_reply(1))
    assert wire.sent == [_reply(0), _reply(1), _reply(1)]


def test_reply_mutations(monkeypatch: pytest.MonkeyPatch) -> None:
    def sent_for(spec: str, rank: int = 1) -> list[bytes]:
        monkeypatch.setenv(faults.ENV, spec)
        faults._reached.clear()
        wire = _Wire([])
        faults.wrap_socket(wire, rank).send(_reply(7, rank))
        return wire.sent

    (frame,) = sent_for("1:reply:corrupt")
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_reply(frame)
    assert decode_reply(sent_for("1:reply:wrong_seq")[0]).seq == 6
    assert decode_reply(sent_for("1:reply:wrong_seq=5")[0]).seq == 12
    assert decode_reply(sent_for("1:reply:wrong_rank")[0]).rank == 101
    assert decode_reply(sent_for("1:reply:wrong_rank=0")[0]).rank == 0
    assert decode_reply(sent_for("1:reply:wrong_epoch")[0]).epoch != 5
    assert decode_reply(sent_for("1:reply:ack")[0]).body == Ack()
    assert sent_for("1:reply#2:ack") == [_reply(7, 1)]  # only the second reply
    assert sent_for("*:reply:duplicate") == [_reply(7, 1)] * 2


def test_slot_mismatch_reverses_a_move_and_trades_decode_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "0:command:slot_mismatch")
    rows = [DecodeRow(r, s, 1, 4, pack_ids([0])) for r, s in ((10, 0), (11, 1))]
    drop = DropRequest(10, Expectation.MUST_EXIST, SlotMove(11, 1, 0))
    wire = faults.wrap_socket(
        _Wire([_command(1, Decode(rows)), _command(2, drop), _command(3, Decode(rows[:1]))]), 0
    )
    assert [row.slot for row in decode_envelope(wire.recv(None)).body.rows] == [1, 0]
    assert decode_envelope(wire.recv(None)).body.move == SlotMove(11, 0, 1)
    assert [row.slot for row in decode_envelope(wire.recv(None)).body.rows] == [1]
