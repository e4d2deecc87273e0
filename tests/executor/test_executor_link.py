"""The coordinator's link, in process over real sockets: what it drops, counts and notices."""

from __future__ import annotations

import time

import pytest

from phalanx.executor.config import ExecutorConfig
from phalanx.executor.errors import ExecutorPoisoned
from phalanx.executor.link import DispatchError, RankLink
from phalanx.executor.model_info import ModelInfo
from phalanx.executor.ranks import RankHandle
from phalanx.executor.replies import StepCollection
from phalanx.executor.runtime import Executor
from phalanx.protocol import PROTOCOL_VERSION, encode
from phalanx.protocol.messages import Ack, Capacity, Failed, Heartbeat, Ping, ReplyEnvelope
from phalanx.protocol.transport import CoordinatorSocket, RankSocket, RuntimeDir, heartbeat_identity

EPOCH = 11


@pytest.fixture
def wired():
    runtime = RuntimeDir()
    sock = CoordinatorSocket(runtime.ipc_address())
    ranks = [RankHandle(0), RankHandle(1)]  # remote ranks: watched through heartbeats
    link = RankLink(sock, ranks, heartbeat_timeout=0.3)
    commands = [RankSocket(sock.address, f"rank-{rank}".encode()) for rank in range(2)]
    beats = [RankSocket(sock.address, heartbeat_identity(f"rank-{rank}".encode())) for rank in range(2)]
    peers = [*commands, *beats]  # a rank's command connection at [rank], its heartbeats' at [2 + rank]
    yield link, peers
    for peer in peers:
        peer.close(linger_ms=0)
    sock.close()
    runtime.remove()


def _send(peer: RankSocket, rank: int, body, epoch: int = EPOCH, seq: int = 1) -> None:
    peer.send(encode(ReplyEnvelope(PROTOCOL_VERSION, epoch, rank, seq, body)))


def _drain(link: RankLink, epoch: int = EPOCH, startup: bool = False, seconds: float = 1.0):
    received = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        received += link.wait(0.05, epoch, startup)
    return received


def test_foreign_epoch_and_garbage_are_dropped_and_counted(wired) -> None:
    link, peers = wired
    for rank in link.ranks:  # as the startup handshake binds them
        rank.identity = f"rank-{rank.rank}".encode()
    _send(peers[0], 0, Ack(), epoch=EPOCH + 1)
    peers[1].send(b"\x00not msgpack")
    _send(peers[3], 1, Heartbeat(0.0))
    _send(peers[0], 0, Ack())
    received = _drain(link, seconds=0.5)
    assert [(reply.rank, reply.body) for _identity, reply in received] == [(0, Ack())]
    assert link.rejected_frames == 2


def test_startup_accepts_epoch_zero_from_ranks_that_do_not_know_it_yet(wired) -> None:
    link, peers = wired
    _send(peers[0], 0, Ack(), epoch=0, seq=0)
    _send(peers[1], 1, Ack(), epoch=5, seq=0)
    received = _drain(link, startup=True, seconds=0.5)
    assert [(identity, reply.rank) for identity, reply in received] == [(b"rank-0", 0)]
    assert link.rejected_frames == 1


def test_silent_remote_rank_is_dead_and_unreachable_rank_fails_dispatch(wired) -> None:
    link, peers = wired
    with pytest.raises(DispatchError, match="rank has not connected"):
        link.broadcast(b"x")
    for rank in link.ranks:
        rank.identity = f"rank-{rank.rank}".encode()
    started = time.monotonic()
    while time.monotonic() - started < 0.6:  # rank 0 beats, rank 1 stays silent
        _send(peers[2], 0, Heartbeat(time.time()))
        link.wait(0.1, EPOCH)
    dead = link.first_death()
    assert dead is not None and dead.rank == 1
    assert dead.death(0.3).startswith("rank 1 sent no heartbeat for ")
    assert link.first_death(among=[0]) is None
    link.ranks[1].identity = b"nobody"
    with pytest.raises(DispatchError, match="failed to dispatch to rank 1"):
        link.broadcast(b"x")


def test_heartbeats_from_a_connection_not_bound_to_the_rank_keep_no_rank_alive(wired) -> None:
    """Signed heartbeats claiming rank 1 from an intruder's connection, and from rank 0's own
    connections, are rejected and counted; rank 1, silent itself, is dead all the same."""
    link, peers = wired
    for rank in link.ranks:
        rank.identity = f"rank-{rank.rank}".encode()
    intruder = RankSocket(link.sock.address, heartbeat_identity(b"rank-9"))
    try:
        started = time.monotonic()
        while time.monotonic() - started < 0.6:
            _send(peers[2], 0, Heartbeat(time.time()))  # rank 0's genuine heartbeat
            for forger in (intruder, peers[0], peers[2]):
                _send(forger, 1, Heartbeat(time.time()))
            link.wait(0.1, EPOCH)
        link.wait(0.1, EPOCH)
    finally:
        intruder.close(linger_ms=0)
    dead = link.first_death()
    assert dead is not None and dead.rank == 1, link.ranks[1].death(0.3)
    assert dead.death(0.3).startswith("rank 1 sent no heartbeat for ")
    assert link.first_death(among=[0]) is None
    assert link.rejected_frames >= 3 * 5
    assert set(link.rejections.by_reason) == {"unbound_peer"}


def test_a_send_that_finds_a_rank_gone_names_the_failure_it_left_behind(wired) -> None:
    """A rank fails a pipelined step and leaves: the next step's send cannot reach it, and the
    executor poisons with the Failed reply already on the way, not with the unreachable host."""
    link, peers = wired
    link.ranks[0].identity = b"rank-0"
    link.ranks[1].identity = b"rank-gone"  # never connected: every send to it fails at once
    executor = Executor(
        ExecutorConfig(model_dir="unused"),
        link,
        EPOCH,
        Capacity(kv_pages=8, page_size=16, max_slots=4, max_batch_tokens=64),
        ModelInfo(vocab_size=64, eos_token_ids=(), max_position_embeddings=128, model_type="qwen3_5"),
        runtime_dir=None,
        first_seq=1,
    )
    _send(peers[0], 0, Failed("execution", "boom", "decode"), seq=1)
    executor._collections[1] = StepCollection("decode", 1, 2)  # the step in flight it failed
    with pytest.raises(ExecutorPoisoned) as poisoned:
        executor.call(Ping())
    assert str(poisoned.value) == "executor is poisoned: rank 0 failed during decode (decode): boom"
