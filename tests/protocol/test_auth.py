"""HMAC frame authentication: round trip, tampering, wrong key, reflection, replay window."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from phalanx.config import settings
from phalanx.executor.launcher import ExecutorConfig, launch_executor
from phalanx.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Decode,
    DecodeRow,
    Envelope,
    Ping,
    Prefill,
    PrefillChunk,
    ReplyEnvelope,
    encode,
    pack_ids,
)
from phalanx.protocol.auth import (
    COORDINATOR,
    OVERHEAD,
    REPLAY_WINDOW,
    FrameAuthenticator,
    key_from_secret,
    new_key,
    rank_authenticator,
    rank_curve_options,
)
from phalanx.protocol.errors import ProtocolError
from tests.support.log_lines import rank_records


def _pair(world: int = 2) -> tuple[FrameAuthenticator, list[FrameAuthenticator]]:
    key = new_key()
    coordinator = FrameAuthenticator(key, COORDINATOR, accept=range(world))
    ranks = [FrameAuthenticator(key, r, accept=[COORDINATOR]) for r in range(world)]
    return coordinator, ranks


def _rejected(auth: FrameAuthenticator, frame: bytes, text: str) -> None:
    before = sum(auth.drops.values())
    with pytest.raises(ProtocolError, match=text) as info:
        auth.verify(frame)
    assert info.value.reason == ProtocolError.UNAUTHENTICATED
    assert sum(auth.drops.values()) == before + 1


def test_round_trip_both_directions() -> None:
    coordinator, ranks = _pair()
    command = coordinator.sign(b"decode")
    assert len(command) == len(b"decode") + OVERHEAD
    assert ranks[0].verify(command) == b"decode"
    assert ranks[1].verify(command) == b"decode"  # one signed frame may go to every rank
    assert coordinator.verify(ranks[1].sign(b"ack")) == b"ack"
    assert coordinator.open(ranks[0].seal(b"done")) == b"done"
    assert not coordinator.drops and not ranks[0].drops


def test_every_flipped_bit_is_rejected() -> None:
    coordinator, ranks = _pair()
    frame = coordinator.sign(b"prefill payload")
    for bit in range(len(frame) * 8):
        damaged = bytearray(frame)
        damaged[bit // 8] ^= 1 << (bit % 8)
        _rejected(ranks[0], bytes(damaged), "wrong HMAC tag")
    assert ranks[0].drops["bad_tag"] == len(frame) * 8
    assert ranks[0].verify(frame) == b"prefill payload"  # the genuine frame still verifies


def test_short_frame_wrong_key_and_unsigned_payload() -> None:
    coordinator, ranks = _pair()
    _rejected(ranks[0], b"", "shorter than the 45-byte minimum")
    _rejected(ranks[0], b"\x00" * 100, "wrong HMAC tag")
    stranger = FrameAuthenticator(new_key(), COORDINATOR)
    _rejected(ranks[0], stranger.sign(b"decode"), "frame claiming coordinator has a wrong HMAC tag")
    _rejected(ranks[0], coordinator.sign(b"x")[:-1], "wrong HMAC tag")
    with pytest.raises(ProtocolError, match="expected 1 frame, got 2"):
        ranks[0].open([b"a", b"b"])


def test_reflected_reply_is_not_a_command() -> None:
    coordinator, ranks = _pair()
    reply = ranks[1].sign(b"ack")
    _rejected(ranks[0], reply, "rank 0 does not accept frames from rank 1")
    _rejected(ranks[1], reply, "rank 1 does not accept frames from rank 1")
    echo = coordinator.sign(b"x")
    _rejected(coordinator, echo, "coordinator does not accept frames from coordinator")


def test_replayed_and_too_old_frames_are_dropped() -> None:
    coordinator, ranks = _pair()
    first = coordinator.sign(b"one")
    second = coordinator.sign(b"two")
    assert ranks[0].verify(second) == b"two"
    assert ranks[0].verify(first) == b"one"  # reordered within the window: accepted once
    _rejected(ranks[0], first, "counter 1 was already accepted")
    _rejected(ranks[0], second, "counter 2 was already accepted")
    frames = [coordinator.sign(b"n") for _ in range(REPLAY_WINDOW + 1)]
    assert ranks[0].verify(frames[-1]) == b"n"
    _rejected(ranks[0], frames[0], "older than the replay window")
    assert ranks[0].verify(frames[1]) == b"n"  # just inside the window
    assert ranks[0].drops == {"replay": 3}


def test_a_frame_of_another_launch_does_not_verify() -> None:
    old = FrameAuthenticator(new_key(), COORDINATOR)
    new = FrameAuthenticator(new_key(), 0, accept=[COORDINATOR])
    _rejected(new, old.sign(b"decode"), "wrong HMAC tag")
    with pytest.raises(ValueError, match="at least 16"):
        FrameAuthenticator(b"short", 0)


def test_the_shared_secret_derives_one_key_and_must_be_long_enough() -> None:
    secret = b"s" * 32
    assert key_from_secret(secret) == key_from_secret(secret) != secret
    assert key_from_secret(b"t" * 32) != key_from_secret(secret)
    with pytest.raises(ValueError, match="at least 16"):
        key_from_secret(b"short")


def test_attached_ranks_need_a_shared_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_SECRET", raising=False)
    with pytest.raises(ValueError, match="needs a shared secret: set PHALANX_SECRET"):
        settings.shared_secret()
    monkeypatch.setenv("PHALANX_SECRET", "a" * 16)
    assert settings.shared_secret() == b"a" * 16


# ---------------------------------------------------------------------------------------------
# Through real ranks over TCP: forged, unsigned and replayed frames are dropped on both sides
# ---------------------------------------------------------------------------------------------


def test_tcp_launch_drops_unsigned_forged_and_replayed_frames(
    tiny_model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = ExecutorConfig(
        model_dir=str(tiny_model_dir),
        tp=1,
        transport="tcp",
        kv_pages=4,
        page_size=16,
        max_slots=2,
        max_batch_tokens=64,
        log_format="json",
    )
    ex = launch_executor(config)
    try:
        assert ex.address.startswith("tcp://127.0.0.1:")
        link = ex._link
        coordinator = link.sock._framer
        chunk = PrefillChunk(1, pack_ids([1, 2, 3]), 0, pack_ids([0]), True)
        (first,) = ex.call(Prefill([chunk])).results  # signed frames flow both ways

        # At the coordinator: a stranger forges rank 0's answer to the next step.
        next_seq = ex._seq + 1
        forged = encode(ReplyEnvelope(PROTOCOL_VERSION, ex.epoch, 0, next_seq, Ack()))
        wrong_key = rank_authenticator(new_key(), 0)
        replayer = rank_authenticator(coordinator._key, 0)  # counters 1..3 were rank 0's own
        stranger = zmq.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        for option, value in rank_curve_options(coordinator._key).items():  # past the encryption
            stranger.setsockopt(option, value)
        stranger.connect(ex.address)
        frames = [forged] * 20 + [wrong_key.sign(forged) for _ in range(20)]
        frames += [replayer.sign(forged) for _ in range(3)]
        for frame in frames:
            stranger.send(frame)
        # At the rank: unsigned commands and a replayed signed one, sent past the framer.
        identity = link.ranks[0].identity
        unsigned = encode(Envelope(PROTOCOL_VERSION, ex.epoch, next_seq, Ping()))
        stale = coordinator.sign(encode(Envelope(PROTOCOL_VERSION, ex.epoch, 1, Ping())))
        for frame in [unsigned] * 20 + [stale, stale]:
            link.sock.socket.send_multipart([identity, frame])

        deadline = time.monotonic() + 10
        while link.rejected_frames < len(frames) and time.monotonic() < deadline:
            ex.call(Ping())
        stranger.close()
        assert link.rejected_frames == len(frames)
        assert coordinator.drops == {"bad_tag": 40}  # the replayed 3 verify on the stranger's own
        assert link.rejected_frames == len(frames)  # connection, which no rank is bound to
        row = DecodeRow(1, 0, first.token, 3, pack_ids([0]))
        ex.call(Decode([row]))  # nothing forged was taken for a reply, nothing unsigned was executed
        assert ex.poison_reason is None
    finally:
        ex.shutdown()
    rank_lines = rank_records(capfd.readouterr().err, rank=0)
    detailed = [r for r in rank_lines if r["event"] == "frame rejected" and r["reason"] == "unauthenticated"]
    assert len(detailed) == 10  # 20 unsigned + the replayed copy: the first ten in full ...
    summaries = [r for r in rank_lines if r["event"] == "frame rejected (summary)"]
    assert summaries and summaries[0]["by_reason"] == {"unauthenticated": 11}  # ... then one a second
    assert sum(r["event"] == "stale command rejected" for r in rank_lines) == 1  # the first copy
