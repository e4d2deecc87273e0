"""The coordinator's side of the sockets: broadcast one frame to every rank, and wait for replies
while watching every rank for death (process sentinels for spawned ranks, heartbeats otherwise)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection

import structlog
import zmq

from phalanx.executor.ranks import RankHandle
from phalanx.protocol import PROTOCOL_VERSION, ProtocolError, decode_reply, encode
from phalanx.protocol.messages import Cancel, Envelope, Heartbeat, ReplyEnvelope
from phalanx.protocol.rejections import RejectionLog
from phalanx.protocol.trace import ALL_RANKS, TraceWriter
from phalanx.protocol.transport import WRONG_KEY, CoordinatorSocket, heartbeat_identity

log = structlog.get_logger("phalanx.executor")

# Longest single wait, so heartbeat silence is checked at least this often.
POLL_SLICE_S = 0.2
# How long a rank's exit may precede its last frame (its Failed reply) on the socket.
LAST_FRAME_GRACE_S = 0.1


class DispatchError(Exception):
    def __init__(self, rank: int, error: str) -> None:
        super().__init__(f"failed to dispatch to rank {rank}: {error}")
        self.rank = rank
        self.error = error


class KeyMismatch(Exception):
    """During startup, a peer's frame failed the HMAC check, or its CURVE handshake failed on the
    key: its key is not the coordinator's. ``peer``: its identity, None when it never connected."""

    def __init__(self, peer: bytes | None, detail: str) -> None:
        super().__init__(detail)
        self.peer = peer
        self.detail = detail


class RankLink:
    def __init__(
        self,
        sock: CoordinatorSocket,
        ranks: list[RankHandle],
        heartbeat_timeout: float,
        trace: TraceWriter | None = None,
    ) -> None:
        self.sock = sock
        self.trace = trace  # records every frame sent and received (``--record``)
        self.ranks = ranks
        self.heartbeat_timeout = heartbeat_timeout
        self.rejections = RejectionLog(log, "reply frame rejected")
        self._poller = zmq.Poller()
        self._poller.register(sock.socket, zmq.POLLIN)
        for rank in ranks:
            if rank.sentinel is not None:
                self._poller.register(rank.sentinel, zmq.POLLIN)

    @property
    def rejected_frames(self) -> int:
        """Frames dropped so far: undecodable, unauthenticated, foreign, or from no rank."""
        return self.rejections.total

    def send_to_peer(self, peer: bytes, payload: bytes, claimed_rank: int = ALL_RANKS) -> None:
        """Send to a connection not bound to a rank (yet): a Challenge to the rank its Hello
        claims, or a Cancel; recorded under ``claimed_rank`` (ALL_RANKS: a peer of no known rank)."""
        if self.trace is not None:
            self.trace.sent(payload, claimed_rank)
        with contextlib.suppress(zmq.ZMQError):  # a peer that left already needs no answer
            self.sock.send(peer, payload)

    def broadcast(self, payload: bytes, ranks: list[RankHandle] | None = None) -> None:
        """Send ``payload`` to every rank (rank order); a rank that cannot be reached raises."""
        if self.trace is not None:
            self.trace.sent_to(payload, None if ranks is None else [rank.rank for rank in ranks])
        for rank in self.ranks if ranks is None else ranks:
            if rank.identity is None:
                raise DispatchError(rank.rank, "rank has not connected")
            try:
                self.sock.send(rank.identity, payload)
            except zmq.ZMQError as exc:
                raise DispatchError(rank.rank, str(exc)) from None
            if not rank.local:
                # Give a remote rank a fresh heartbeat window for this step.
                rank.heard()

    def wait(self, timeout_s: float, epoch: int, startup: bool = False) -> list[tuple[bytes, ReplyEnvelope]]:
        """Replies that arrive within ``min(timeout_s, POLL_SLICE_S)`` (heartbeats only update
        liveness). Frames that fail decoding or carry a foreign epoch are dropped and counted.
        During startup a rank that does not know the epoch yet may send epoch 0, and a frame with
        a wrong HMAC tag raises KeyMismatch (a rank with another secret never gets better)."""
        events = dict(self._poller.poll(max(0.0, min(timeout_s, POLL_SLICE_S)) * 1000))
        exited = [rank for rank in self.ranks if rank.sentinel is not None and rank.sentinel in events]
        if exited:
            # A rank exited: a failing rank sends Failed first, so give its last frame time to land.
            time.sleep(LAST_FRAME_GRACE_S)
            # Its exit code tells the rest (first_death); a sentinel left registered would stay
            # readable and turn every later wait into a busy loop.
            for rank in exited:
                self._poller.unregister(rank.sentinel)
        self._count_failed_handshakes(startup)
        received: list[tuple[bytes, ReplyEnvelope]] = []
        while self.sock.socket.poll(0):
            try:
                identity, frame = self.sock.recv_ready()
                if self.trace is not None:
                    self.trace.received(frame)
                reply = decode_reply(frame, epoch=None if startup else epoch)
                if startup and reply.epoch not in (0, epoch):
                    raise ProtocolError(
                        ProtocolError.FOREIGN_EPOCH, f"reply has epoch {reply.epoch}, expected {epoch}"
                    )
                if isinstance(reply.body, Heartbeat):
                    self._check_heartbeat(identity, reply.rank)
                elif not startup:
                    self._check_bound(identity, reply.rank)
            except ProtocolError as exc:
                if startup and exc.cause == "bad_tag" and exc.peer is not None:
                    raise KeyMismatch(exc.peer, exc.detail) from None
                self.rejections.record(exc.reason, detail=exc.detail)
                continue
            self._heard(identity, reply.rank)
            if not isinstance(reply.body, Heartbeat):
                received.append((identity, reply))
        return received

    def _count_failed_handshakes(self, startup: bool) -> None:
        """A peer whose CURVE handshake failed delivered nothing; count it with the rejected
        frames. During startup a wrong key means a rank holds another secret: KeyMismatch."""
        for code in self.sock.handshake_failures():
            if startup and code == WRONG_KEY:
                raise KeyMismatch(None, "a peer's encrypted (CURVE) handshake failed on the key")
            self.rejections.record(
                ProtocolError.UNAUTHENTICATED,
                detail=f"a peer's CURVE handshake failed (ZMTP error {code:#x})",
            )

    def _heard(self, identity: bytes, rank: int) -> None:
        """A frame keeps a rank alive only when it came from that rank's bound connection or its
        heartbeat connection."""
        if 0 <= rank < len(self.ranks):
            bound = self.ranks[rank].identity
            if bound is not None and identity in (bound, heartbeat_identity(bound)):
                self.ranks[rank].heard()

    def _check_heartbeat(self, identity: bytes, rank: int) -> None:
        """A heartbeat counts only from the heartbeat connection of the connection bound to the
        rank it claims: a forged one cannot keep a dead rank alive."""
        bound = self.ranks[rank].identity if 0 <= rank < len(self.ranks) else None
        if bound is None or identity != heartbeat_identity(bound):
            raise ProtocolError(
                ProtocolError.UNBOUND_PEER,
                f"a heartbeat claiming rank {rank} came from a connection not bound to that rank",
            )

    def _check_bound(self, identity: bytes, rank: int) -> None:
        """A reply counts only from a connection that a rank's handshake bound (which rank it
        claims is for the reply's validation to judge)."""
        if all(handle.identity != identity for handle in self.ranks):
            raise ProtocolError(
                ProtocolError.UNBOUND_PEER,
                f"a reply claiming rank {rank} came from a connection no rank is bound to",
            )

    def first_death(
        self, local_only: bool = False, among: Collection[int] | None = None
    ) -> RankHandle | None:
        """The first rank that counts as dead, considering only ranks ``among`` (default all)."""
        for rank in self.ranks:
            if (local_only and not rank.local) or (among is not None and rank.rank not in among):
                continue
            if rank.death(self.heartbeat_timeout) is not None:
                return rank
        return None

    def killed_peer(self, failed_rank: int) -> RankHandle | None:
        """A local rank other than ``failed_rank`` killed by a signal, waiting up to
        LAST_FRAME_GRACE_S for its exit to show. A rank whose peer was killed mid-collective fails
        too (connection reset); the killed peer, which could report nothing, is the cause."""
        deadline = time.monotonic() + LAST_FRAME_GRACE_S
        while True:
            for rank in self.ranks:
                if rank.rank != failed_rank and rank.local and (rank.exitcode or 0) < 0:
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def stop_all(self, grace_s: float) -> None:
        """Give local ranks ``grace_s`` to exit on their own, then kill and reap them."""
        deadline = time.monotonic() + grace_s
        for rank in self.ranks:
            rank.join(max(0.0, deadline - time.monotonic()))
        self.kill_all()

    def kill_all(self, reason: str = "", epoch: int = 0) -> None:
        """Kill and reap every local rank; tell remote ranks (which cannot be killed from here)
        to leave with Cancel."""
        for rank in self.ranks:
            if not rank.local and rank.identity is not None and reason:
                cancel = encode(Envelope(PROTOCOL_VERSION, epoch, 0, Cancel(reason)))
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.send(rank.identity, cancel)
            rank.kill()
        for rank in self.ranks:
            if not rank.join(10.0):
                log.error("rank did not exit after SIGKILL", dead_rank=rank.rank)
