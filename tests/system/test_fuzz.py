"""Fuzz: thousands of random, truncated, bit-flipped and wrong-type frames at a rank's command
socket and at the coordinator's reply socket. None is executed, no process crashes, and every one
is counted (by the rank's rejection log, by the link's rejection counter)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from phalanx.executor.launcher import ExecutorConfig, launch_executor
from phalanx.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Capacity,
    Decode,
    DecodeDone,
    DecodeRow,
    DropRequest,
    Envelope,
    Expectation,
    Go,
    Hello,
    Ping,
    Prefill,
    PrefillChunk,
    Ready,
    ReplyEnvelope,
    SlotMove,
    TokenResult,
    encode,
    pack_ids,
)
from phalanx.protocol.trace import Direction, read_trace
from tests.support.log_lines import rank_records
from tests.support.runtime_helpers import rank_pids

FRAMES_PER_SOCKET = 10_000
FOREIGN = 0xFFFF_FFFF_0000  # xor-ed into the epoch: far more bits than a few flips can undo


def _commands() -> list[object]:
    chunk = PrefillChunk(7, pack_ids([1, 2, 3, 4]), 0, pack_ids([0, 1]), True)
    row = DecodeRow(7, 0, 5, 4, pack_ids([0, 1]))
    return [
        Ping(),
        Prefill([chunk]),
        Decode([row, row]),
        DropRequest(7, Expectation.MUST_EXIST, SlotMove(8, 1, 0)),
        Go(Capacity(4, 16, 2, 64), "tcp://127.0.0.1:1", "gloo"),
    ]


def _replies() -> list[object]:
    return [
        Ack(),
        DecodeDone([TokenResult(7, 9, -0.5, [9, 3], [-0.5, -1.0])]),
        Ready(Capacity(4, 16, 2, 64), "cpu", 1, "h"),
    ]


def _bit_flip(rng: random.Random, frame: bytes) -> bytes:
    damaged = bytearray(frame)
    for _ in range(rng.randint(1, 3)):
        bit = rng.randrange(len(damaged) * 8)
        damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


def fuzz_frames(rng: random.Random, epoch: int, count: int, to_rank: bool) -> list[bytes]:
    """Frames that must all be rejected: a rank's, or the coordinator's, point of view."""

    def valid(body: object, epoch: int, seq: int) -> bytes:
        if to_rank:
            return encode(Envelope(PROTOCOL_VERSION, epoch, seq, body))
        return encode(ReplyEnvelope(PROTOCOL_VERSION, epoch, 0, seq, body))

    bodies = _commands() if to_rank else _replies()
    wrong_direction = _replies() if to_rank else _commands()
    frames = []
    for i in range(count):
        kind = i % 4
        body = rng.choice(bodies)
        if kind == 0:  # random bytes
            frames.append(rng.randbytes(rng.randrange(0, 200)))
        elif kind == 1:  # a valid frame of this launch, truncated
            frame = valid(body, epoch, rng.randrange(10**6, 10**9))
            frames.append(frame[: rng.randrange(len(frame))])
        elif kind == 2:  # another launch's frame with a few bits flipped
            frames.append(_bit_flip(rng, valid(body, epoch ^ FOREIGN, rng.randrange(10**6, 10**9))))
        else:  # well-formed msgpack of the wrong type, version, direction or staleness
            choice = rng.randrange(5)
            if choice == 0:
                frames.append(
                    msgspec.msgpack.encode(rng.choice([1, "ping", [1, 2], {"op": "ping"}, None, 2.5]))
                )
            elif choice == 1:
                frames.append(
                    msgspec.msgpack.encode({"proto": 1, "epoch": epoch, "seq": "x", "body": {"op": "ping"}})
                )
            elif choice == 2:  # the other direction's message, this launch's epoch
                other = rng.choice(wrong_direction)
                frames.append(
                    encode(ReplyEnvelope(PROTOCOL_VERSION, epoch, 0, 10**6, other))
                    if to_rank
                    else encode(Envelope(PROTOCOL_VERSION, epoch, 10**6, other))
                )
            elif choice == 3:  # a future protocol version
                frames.append(
                    msgspec.msgpack.encode(
                        {"proto": PROTOCOL_VERSION + 1, "epoch": epoch, "seq": 10**6, "body": {"op": "ping"}}
                    )
                )
            else:  # unknown tag
                frames.append(
                    msgspec.msgpack.encode(
                        {"proto": 1, "epoch": epoch, "seq": 10**6, "body": {"op": "format_disk"}}
                    )
                )
    return frames


def _send_all(sock: zmq.Socket, identity: bytes | None, frames: list[bytes]) -> None:
    """Send every frame, waiting whenever the peer's queue is full."""
    for frame in frames:
        parts = [identity, frame] if identity is not None else [frame]
        while True:
            try:
                sock.send_multipart(parts, flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                time.sleep(0.001)


def test_fuzz_rank_and_coordinator_sockets(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(20261129)
    trace_path = tmp_path / "fuzz.trace"
    config = ExecutorConfig(
        model_dir=str(tiny_model_dir),
        tp=1,
        kv_pages=4,
        page_size=16,
        max_slots=2,
        max_batch_tokens=64,
        step_timeout=20.0,
        record=str(trace_path),
        log_format="json",
    )
    ex = launch_executor(config)
    try:
        link = ex._link
        (pid,) = rank_pids(ex)
        # -- at the rank's command socket, through the coordinator's own ROUTER ---------------
        rank_frames = fuzz_frames(rng, ex.epoch, FRAMES_PER_SOCKET, to_rank=True)
        _send_all(link.sock.socket, link.ranks[0].identity, rank_frames)
        ex.call(Ping())  # queued behind every fuzz frame: once it is answered, all were handled
        # -- at the coordinator's reply socket, from a stranger's DEALER -----------------------
        stranger = zmq.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.SNDHWM, 0)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(ex.address)
        reply_frames = fuzz_frames(rng, ex.epoch, FRAMES_PER_SOCKET, to_rank=False)
        _send_all(stranger, None, reply_frames)
        deadline = time.monotonic() + 30
        while link.rejected_frames < FRAMES_PER_SOCKET and time.monotonic() < deadline:
            ex.call(Ping())
        stranger.close()
        assert link.rejected_frames == FRAMES_PER_SOCKET
        assert ex.poison_reason is None
        ex.call(Ping())
        os.kill(pid, 0)  # the rank is alive (ProcessLookupError otherwise)
    finally:
        ex.shutdown()

    err = capfd.readouterr().err
    rank_lines = rank_records(err, rank=0)
    # every frame was rejected; the log holds the first ten in full, then a summary a second
    detailed = [r for r in rank_lines if r["event"] == "frame rejected"]
    summaries = [r for r in rank_lines if r["event"] == "frame rejected (summary)"]
    assert len(detailed) == 10 and 1 <= len(summaries) <= 30, summaries
    assert not any(r["level"] == "error" for r in rank_lines)

    # The trace holds every frame the coordinator received: besides the fuzz, only Acks to our
    # own commands. Nothing was executed, so nothing else was answered.
    trace = read_trace(trace_path)
    decoded = [e for e in trace.entries if e.direction is Direction.RECV and e.message is not None]
    ours = {e.seq for e in trace.entries if e.direction is Direction.SEND}
    from_rank = [e for e in decoded if e.message.epoch == ex.epoch]
    assert all(isinstance(e.message.body, Ack | Hello | Ready) and e.seq in ours for e in from_rank)
    assert sum(1 for e in trace.entries if e.direction is Direction.RECV) >= FRAMES_PER_SOCKET
