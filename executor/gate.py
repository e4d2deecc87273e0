"""The startup gate: Ready or Failed from every rank within a deadline, then Go with the effective
capacity (the element-wise minimum) or Cancel, then a first Ping that every rank answers once its
distributed init is done. Any failure names the rank and the phase."""

from __future__ import annotations

import time

import structlog

from executor.errors import StartupError
from executor.link import RankLink
from protocol import PROTOCOL_VERSION, encode
from protocol.messages import Ack, Cancel, Capacity, Envelope, Failed, Go, Ping, Ready

log = structlog.get_logger("phalanx.executor")

# The first Ping after Go carries seq 1; startup messages carry seq 0.
FIRST_PING_SEQ = 1


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


def _collect_ready(link: RankLink, epoch: int, deadline: float, timeout: float) -> dict[int, Ready]:
    world_size = len(link.ranks)
    ready: dict[int, Ready] = {}
    while len(ready) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [rank for rank in range(world_size) if rank not in ready]
            raise StartupError(
                f"startup did not complete within {timeout:g} s: no Ready from ranks {missing}",
                missing[0] if len(missing) == 1 else None,
                "startup:load",
            )
        for identity, reply in link.wait(remaining, epoch, startup=True):
            if not 0 <= reply.rank < world_size:
                raise StartupError(
                    f"a rank reported out-of-range rank {reply.rank} for world size {world_size}"
                )
            if isinstance(reply.body, Failed):
                raise _failure(reply.rank, reply.body)
            if not isinstance(reply.body, Ready):
                continue
            if reply.rank in ready:
                raise StartupError(f"rank {reply.rank} reported Ready twice", reply.rank, "startup:gate")
            ready[reply.rank] = reply.body
            link.ranks[reply.rank].identity = identity
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
    link: RankLink, epoch: int, timeout: float, dist_init_method: str, dist_backend: str
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
    link.broadcast(encode(Envelope(PROTOCOL_VERSION, epoch, 0, Go(capacity, dist_init_method, dist_backend))))
    _await_first_ping(link, epoch, deadline, timeout)
    return capacity
