"""Launching a replica: spawn the ranks (or accept ranks that connect on their own over TCP),
run the startup gate, and hand back a serving Executor."""

from __future__ import annotations

import multiprocessing
import secrets

import structlog

from phalanx.config import settings
from phalanx.executor.config import ExecutorConfig
from phalanx.executor.errors import StartupError
from phalanx.executor.gate import FIRST_PING_SEQ, run_startup_gate
from phalanx.executor.link import RankLink
from phalanx.executor.logs import bind, configure_logging
from phalanx.executor.model_info import read_model_info
from phalanx.executor.precapture import precapture_decode_graphs
from phalanx.executor.ranks import RankHandle
from phalanx.executor.runtime import Executor
from phalanx.protocol.auth import (
    coordinator_authenticator,
    coordinator_curve_options,
    key_from_secret,
    new_key,
)
from phalanx.protocol.launch import WORKER_ENTRY, encode_config, rank_config, run_entry
from phalanx.protocol.trace import open_trace
from phalanx.protocol.transport import CoordinatorSocket, RuntimeDir, tcp_address

__all__ = ["ExecutorConfig", "launch_executor"]

log = structlog.get_logger("phalanx.executor")

# Collectives time out before the step does: a rank waiting for a hung peer then fails in time
# for the coordinator to name the peer (the one that did not answer) within the step's deadline.
COLLECTIVE_SHARE_OF_STEP = 0.8


def _auth_key(config: ExecutorConfig) -> bytes | None:
    """TCP frames are authenticated: a fresh key for spawned ranks, the shared secret's otherwise."""
    if config.parallel.transport != "tcp":
        return None
    return key_from_secret(settings.shared_secret()) if config.parallel.attach else new_key()


def _spawn_ranks(config: ExecutorConfig, address: str, epoch: int, key: bytes | None) -> list[RankHandle]:
    context = multiprocessing.get_context("spawn")
    ranks = []
    for rank in range(config.parallel.tp):
        process = context.Process(
            target=run_entry,
            args=(WORKER_ENTRY, encode_config(rank_config(config, rank, rank, address, epoch, key))),
            name=f"phalanx-rank-{rank}",
            daemon=True,
        )
        process.start()
        ranks.append(RankHandle(rank, process))
    return ranks


def launch_executor(config: ExecutorConfig) -> Executor:
    """Start every rank and return once all serve; raises StartupError (every rank stopped)."""
    configure_logging(config.log.log_level, config.log.log_format)
    model_info = read_model_info(config.model.model_dir)
    epoch = secrets.randbits(62) | 1
    bind(epoch, 0)
    parallel = config.parallel
    # Spawned ranks share this host: their sockets and rendezvous file live in a private directory.
    runtime_dir = None if parallel.attach else RuntimeDir()
    if parallel.transport == "ipc" and runtime_dir is not None:
        address = runtime_dir.ipc_address()
    else:
        address = tcp_address(parallel.host, parallel.port)
    key = _auth_key(config)
    sock = (  # TCP: frames signed, connections encrypted (CURVE), both under the launch's key
        CoordinatorSocket(
            address, coordinator_authenticator(key, parallel.tp), coordinator_curve_options(key)
        )
        if key
        else CoordinatorSocket(address)
    )
    if parallel.attach:
        log.info("waiting for ranks to connect", address=sock.address, world_size=parallel.tp)
        ranks = [RankHandle(rank) for rank in range(parallel.tp)]
        dist_init_method = "env://"
    else:
        ranks = _spawn_ranks(config, sock.address, epoch, key)
        # A file store, not a TCPStore: rank 0's TCPStore would listen on every interface.
        dist_init_method = f"file://{runtime_dir.path}/dist-store"
    trace = (
        open_trace(config.log.record, epoch=epoch, world_size=parallel.tp, meta=config.flat())
        if config.log.record
        else None
    )
    link = RankLink(sock, ranks, config.timeouts.heartbeat_timeout, trace)
    backend = "nccl" if parallel.device == "cuda" else "gloo"
    try:
        capacity = run_startup_gate(
            link,
            epoch,
            config.timeouts.startup_timeout,
            dist_init_method,
            backend,
            collective_timeout=config.timeouts.step_timeout * COLLECTIVE_SHARE_OF_STEP,
        )
    except BaseException as exc:
        stopped = not isinstance(exc, Exception)  # Ctrl-C or SIGTERM: the caller reports the stop
        if stopped:  # nothing a starting rank holds is worth waiting for
            log.info("startup stopped", by=type(exc).__name__)
            link.kill_all(reason=f"the coordinator was stopped ({type(exc).__name__})", epoch=epoch)
        else:
            log.error("startup failed", error=str(exc))
            link.stop_all(grace_s=5.0)
        sock.close()
        if runtime_dir is not None:
            runtime_dir.remove()
        if stopped:
            raise
        exit_codes = {rank.rank: rank.exitcode for rank in ranks}
        if isinstance(exc, StartupError):
            exc.exit_codes = exit_codes
            raise
        error = StartupError(f"startup failed: {exc}")
        error.exit_codes = exit_codes
        raise error from exc
    executor = Executor(config, link, epoch, capacity, model_info, runtime_dir, FIRST_PING_SEQ)
    try:
        if config.model.cuda_graph:
            precapture_decode_graphs(executor)
        log.info(
            "executor serving",
            world_size=parallel.tp,
            capacity=capacity,
            address=sock.address,
            launch_epoch=epoch,
        )
    except BaseException:  # a failed sweep (StartupError), or Ctrl-C / SIGTERM during it
        executor.shutdown()
        raise
    return executor
