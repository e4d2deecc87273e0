"""The startup gate: the handshake that binds each rank to its connection (``protocol.messages``),
Ready or Failed from every rank within a deadline, then Go with the effective
capacity (the element-wise minimum) or Cancel, then a first Ping that every rank answers once its
distributed init is done. Any failure names the rank and the phase."""

from __future__ import annotations

import hmac
import secrets
import time

import structlog

from phalanx.executor.errors import StartupError
from phalanx.executor.link import KeyMismatch, RankLink
from phalanx.protocol import PROTOCOL_VERSION, encode
from phalanx.protocol.auth import SECRET_ENV
from phalanx.protocol.messages import (
    Ack,
    Cancel,
    Capacity,
    Challenge,
    Envelope,
    Failed,
    Go,
    Hello,
    Ping,
    Ready,
)

log = structlog.get_logger("phalanx.executor")

# The first Ping after Go carries seq 1; startup messages carry seq 0.
FIRST_PING_SEQ = 1
# A first start on a fresh machine compiles every kernel before Ready (minutes): the wait says so.
WAITING_NOTICE_S = 30.0


def effective_capacity(ready: dict[int, Ready]) -> Capacity:
    capacities = [ready[rank].capacity for rank in sorted(ready)]
    page_sizes = {capacity.page_size for capacity in capacities}
    if len(page_sizes) != 1:
        raise StartupError(
            f"ranks report different page sizes {sorted(page_sizes)}", phase="startup:capacity"
        )
    effective = Capacity(
        kv_pages=min(capacity.kv_pages for capacity in capacities),
        page_size=capacities[0].page_size,
        max_slots=min(capacity.max_slots for capacity in capacities),
        max_batch_tokens=min(capacity.max_batch_tokens for capacity in capacities),
        snapshot_slots=min(capacity.snapshot_slots for capacity in capacities),
    )
    if effective.kv_pages < 1 or effective.max_slots < 1 or effective.max_batch_tokens < 1:
        raise StartupError(
            f"effective capacity {effective} cannot hold one request", phase="startup:capacity"
        )
    return effective


def _failure(rank: int, failed: Failed) -> StartupError:
    return StartupError(f"rank {rank} failed during {failed.phase}: {failed.message}", rank, failed.phase)


def _death(link: RankLink, phase: str) -> None:
    dead = link.first_death(local_only=True)
    if dead is not None:
        raise StartupError(
            f"rank {dead.rank} exited with code {dead.exitcode} during {phase}", dead.rank, phase
        )


class _Handshakes:
    """Which connection is which rank: a signed Hello gets a Challenge with a nonce for that
    connection; the first Ready that echoes it binds the rank to the connection."""

    def __init__(self, link: RankLink, epoch: int) -> None:
        self.link = link
        self.epoch = epoch
        self.nonces: dict[bytes, bytes] = {}
        self.refused_claims: set[int] = set()  # ranks whose second claim was logged (once each)

    def hello(self, peer: bytes, claimed_rank: int) -> None:
        nonce = secrets.token_bytes(16)
        self.nonces[peer] = nonce
        challenge = encode(Envelope(PROTOCOL_VERSION, self.epoch, 0, Challenge(nonce)))
        self.link.send_to_peer(peer, challenge, claimed_rank)

    def bind(self, peer: bytes, rank: int, ready: Ready, epoch: int) -> bool:
        """Bind ``rank`` to ``peer``; False (and logged) when the Ready is refused."""
        expected = self.nonces.get(peer)
        if epoch != self.epoch or expected is None or not hmac.compare_digest(expected, ready.nonce):
            log.warning(
                "ready refused: it does not answer this connection's challenge (a replayed hello)",
                claimed_rank=rank,
            )
            return False
        handle = self.link.ranks[rank]
        if handle.identity == peer:
            raise StartupError(f"rank {rank} reported Ready twice", rank, "startup:gate")
        if handle.identity is not None:
            if rank not in self.refused_claims:
                self.refused_claims.add(rank)
                log.error("a second claim of a bound rank refused", claimed_rank=rank)
            return False
        handle.identity = peer
        return True


def _key_mismatch(link: RankLink, epoch: int, exc: KeyMismatch) -> StartupError:
    """Tell the peer (it cannot verify the Cancel either, which is how it learns; one that never
    connected sees its own handshake fail) and fail."""
    reason = (
        f"a rank's frames fail authentication ({exc.detail}): {SECRET_ENV} differs between the "
        "coordinator and that rank"
    )
    if exc.peer is not None:
        link.send_to_peer(exc.peer, encode(Envelope(PROTOCOL_VERSION, epoch, 0, Cancel(reason))))
    return StartupError(reason, phase="startup:handshake")


def _collect_ready(link: RankLink, epoch: int, deadline: float, timeout: float) -> dict[int, Ready]:
    world_size = len(link.ranks)
    ready: dict[int, Ready] = {}
    handshakes = _Handshakes(link, epoch)
    started = time.monotonic()
    next_notice = started + WAITING_NOTICE_S
    while len(ready) < world_size:
        now = time.monotonic()
        remaining = deadline - now
        missing = [rank for rank in range(world_size) if rank not in ready]
        if now >= next_notice and remaining > 0:
            log.info(
                "waiting for ranks to load, compile and profile (a fresh machine compiles every kernel once)",
                missing_ranks=missing,
                waited_s=round(now - started),
                timeout_s=timeout,
            )
            next_notice = now + WAITING_NOTICE_S
        if remaining <= 0:
            raise StartupError(
                f"startup did not complete within {timeout:g} s: no Ready from ranks {missing}",
                missing[0] if len(missing) == 1 else None,
                "startup:load",
            )
        try:
            replies = link.wait(remaining, epoch, startup=True)
        except KeyMismatch as exc:
            raise _key_mismatch(link, epoch, exc) from None
        for identity, reply in replies:
            if not 0 <= reply.rank < world_size:
                raise StartupError(
                    f"a rank reported out-of-range rank {reply.rank} for world size {world_size}"
                )
            if isinstance(reply.body, Failed):
                raise _failure(reply.rank, reply.body)
            if isinstance(reply.body, Hello):
                handshakes.hello(identity, reply.rank)
            if not isinstance(reply.body, Ready) or not handshakes.bind(
                identity, reply.rank, reply.body, reply.epoch
            ):
                continue
            ready[reply.rank] = reply.body
            log.info("rank ready", ready_rank=reply.rank, host=reply.body.host, capacity=reply.body.capacity)
        if len(ready) < world_size:
            _death(link, "startup:load")
    return ready


def _await_first_ping(link: RankLink, epoch: int, deadline: float, timeout: float) -> None:
    link.broadcast(encode(Envelope(PROTOCOL_VERSION, epoch, FIRST_PING_SEQ, Ping())))
    answered: set[int] = set()
    while len(answered) < len(link.ranks):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [rank for rank in range(len(link.ranks)) if rank not in answered]
            raise StartupError(
                f"distributed init did not complete within the {timeout:g} s startup deadline on ranks {missing}",
                missing[0] if len(missing) == 1 else None,
                "startup:dist_init",
            )
        for _identity, reply in link.wait(remaining, epoch):
            if isinstance(reply.body, Failed):
                raise _failure(reply.rank, reply.body)
            if (
                isinstance(reply.body, Ack)
                and reply.seq == FIRST_PING_SEQ
                and 0 <= reply.rank < len(link.ranks)
            ):
                answered.add(reply.rank)
        if len(answered) < len(link.ranks):
            _death(link, "startup:dist_init")


def run_startup_gate(
    link: RankLink,
    epoch: int,
    timeout: float,
    dist_init_method: str,
    dist_backend: str,
    collective_timeout: float = 0.0,
) -> Capacity:
    """Returns the effective capacity once every rank serves; raises StartupError otherwise
    (after sending Cancel to the ranks that are waiting for a decision)."""
    deadline = time.monotonic() + timeout
    try:
        ready = _collect_ready(link, epoch, deadline, timeout)
        capacity = effective_capacity(ready)
    except StartupError as exc:
        cancel = encode(Envelope(PROTOCOL_VERSION, epoch, 0, Cancel(str(exc))))
        for rank in link.ranks:
            if rank.identity is not None:
                try:
                    link.broadcast(cancel, [rank])
                except Exception as send_error:  # a dead rank cannot be told; it is killed next
                    log.warning("cancel not delivered", cancel_rank=rank.rank, error=str(send_error))
        raise
    log.info("startup gate open", capacity=capacity)
    link.broadcast(
        encode(
            Envelope(
                PROTOCOL_VERSION, epoch, 0, Go(capacity, dist_init_method, dist_backend, collective_timeout)
            )
        )
    )
    _await_first_ping(link, epoch, deadline, timeout)
    return capacity
