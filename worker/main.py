"""One rank from start to exit: bind the device, load the shard, size capacity, report Ready or
Failed, wait for Go or Cancel, initialise torch.distributed under the startup watchdog, allocate
the caches, then run the command loop.

Exit codes: 0 after Shutdown, 1 after a failure (startup or poison), 3 after Cancel.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch
from setproctitle import setproctitle
from tqdm import tqdm

from phalanx.protocol import PROTOCOL_VERSION, ProtocolError, decode_envelope, encode
from phalanx.protocol.auth import SECRET_ENV, rank_authenticator, rank_curve_options
from phalanx.protocol.buckets import MAX_GRAPH_BATCH, bucket_for
from phalanx.protocol.launch import WorkerConfig
from phalanx.protocol.messages import (
    Cancel,
    Capacity,
    Challenge,
    Failed,
    Go,
    Hello,
    Precapture,
    Ready,
    ReplyEnvelope,
)
from phalanx.protocol.transport import HANDSHAKE_FAILED, RankSocket, connection_identity, heartbeat_identity
from phalanx.worker.buckets import state_slot_layout
from phalanx.worker.capacity import GIB, CapacityError, batch_tokens_for, memory_line, size_capacity
from phalanx.worker.commands import StepRunner
from phalanx.worker.cores import ranks_on_this_host
from phalanx.worker.faults import fault_point, wrap_socket
from phalanx.worker.grammar import GrammarTable
from phalanx.worker.graphs import build_graph_runner, precapture_handler
from phalanx.worker.heartbeat import HeartbeatThread
from phalanx.worker.logs import bind_epoch, configure_logging
from phalanx.worker.loop import EXIT_CANCELLED, EXIT_OK, EXIT_POISONED, CommandLoop
from phalanx.worker.memory_profile import measure_activations
from phalanx.worker.prefill_graphs import GRAPHED_PREFILL_TOKENS, PrefillGraphRunner
from phalanx.worker.snapshots import SnapshotTable
from phalanx.worker.watchdog import Watchdog

log = structlog.get_logger("phalanx.worker")


class StartupFailure(Exception):
    def __init__(self, phase: str, cause: BaseException, epoch: int) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.phase = phase
        self.epoch = epoch  # the launch's epoch once Go taught it, else the configured one


def _device(config: WorkerConfig) -> torch.device:
    if config.device == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if config.local_rank >= visible:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise RuntimeError(
                f"rank {config.rank}: device cuda:{config.local_rank} asked for, but torch "
                f"({torch.__version__}, {build}) sees {visible} CUDA GPU(s) on this host"
            )
        torch.cuda.set_device(config.local_rank)
        return torch.device("cuda", config.local_rank)
    if config.device != "cpu":
        raise ValueError(f"unknown device {config.device!r} (cpu or cuda)")
    # Ranks on one host share its cores; oversubscribing them slows every collective.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_host(config.world_size)))
    return torch.device("cpu")


def _dtype(config: WorkerConfig) -> torch.dtype:
    if config.dtype:
        return getattr(torch, config.dtype)
    return torch.bfloat16 if config.device == "cuda" else torch.float32


# How often a rank waiting for the coordinator looks whether its handshake was refused.
HANDSHAKE_CHECK_S = 0.2


class SecretMismatch(RuntimeError):
    """The coordinator's frames fail this rank's authentication: the keys differ."""


def _wait_for(
    sock: RankSocket, config: WorkerConfig, epoch: int | None, kinds: tuple[type, ...], what: str
) -> tuple[int, Any]:
    """Block until a command of ``kinds`` (or Cancel) arrives within the gate timeout; returns
    (its epoch, its body). Frames from the coordinator with a wrong tag, or a coordinator that
    refuses our encrypted handshake, mean the two sides hold different keys, which no wait
    mends: that raises SecretMismatch at once."""
    deadline = time.monotonic() + config.gate_timeout
    while (remaining := deadline - time.monotonic()) > 0:
        if sock.handshake_failed():
            raise SecretMismatch(
                f"the coordinator refused this rank's encrypted (CURVE) handshake: {SECRET_ENV} "
                "differs between the coordinator and this rank"
            )
        try:
            frame = sock.recv(min(remaining, HANDSHAKE_CHECK_S))
            if frame is None:
                continue
            envelope = decode_envelope(frame, epoch=epoch or None)
        except ProtocolError as exc:
            if exc.cause == "bad_tag":
                raise SecretMismatch(
                    f"the coordinator's frames fail authentication ({exc.detail}): {SECRET_ENV} differs "
                    "between the coordinator and this rank"
                ) from None
            log.warning(f"frame rejected while waiting for {what}", reason=exc.reason, detail=exc.detail)
            continue
        if isinstance(envelope.body, (*kinds, Cancel)):
            return envelope.epoch, envelope.body
        log.warning(f"unexpected command before {what}", op=type(envelope.body).__name__)
    raise TimeoutError(f"no {what} from the coordinator within {config.gate_timeout:g} s")


def _handshake(sock: RankSocket, config: WorkerConfig) -> tuple[int, Challenge | Cancel]:
    """Claim this rank with a signed Hello; the Challenge answers with the launch's epoch and the
    nonce that Ready must echo."""
    sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, config.epoch, config.rank, 0, Hello())))
    return _wait_for(sock, config, config.epoch, (Challenge,), "challenge")


def _init_distributed(config: WorkerConfig, go: Go, device: torch.device) -> None:
    if config.world_size == 1:
        return
    with Watchdog(config.dist_init_timeout, config.rank, "startup:dist_init"):
        fault_point("dist_init", config.rank)
        torch.distributed.init_process_group(
            backend=go.dist_backend,
            init_method=go.dist_init_method,
            rank=config.rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=go.collective_timeout or config.dist_init_timeout),
            device_id=device if device.type == "cuda" else None,
        )
        # The rendezvous alone does not prove the links work: one collective does.
        probe = torch.ones(1, device=device)
        torch.distributed.all_reduce(probe)
        if int(probe.item()) != config.world_size:
            raise RuntimeError(f"dist init probe summed to {probe.item()}, expected {config.world_size}")


def _startup(sock: RankSocket, config: WorkerConfig) -> tuple[StepRunner, int] | int:
    """Returns (runner, epoch) when serving may start, or an exit code."""
    from phalanx.models.qwen35 import Qwen35Model, recurrent_state_dtype

    phase = "startup:handshake"
    epoch = config.epoch
    try:
        epoch, challenge = _handshake(sock, config)
        if isinstance(challenge, Cancel):
            log.warning("startup cancelled", reason=challenge.reason)
            return EXIT_CANCELLED
        bind_epoch(epoch)
        phase = "startup:device"
        device = _device(config)
        phase = "startup:load"
        fault_point("load", config.rank)
        try:
            model = Qwen35Model.load(
                config.model_dir,
                rank=config.rank,
                world_size=config.world_size,
                device=device,
                dtype=_dtype(config),
                state_dtype=recurrent_state_dtype(config.limits.recurrent_state_dtype, _dtype(config)),
                # One bar per host is readable; CPU loads (tests, the demo) are too short to need one.
                progress=config.device == "cuda" and config.local_rank == 0,
            )
        except torch.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(device)
            raise CapacityError(
                f"rank {config.rank}: the model's weights do not fit on {device} "
                f"({total / GIB:.1f} GiB, {free / GIB:.1f} GiB free); use more GPUs (--tp)"
            ) from exc
        phase = "startup:capacity"
        limits = batch_tokens_for(config.limits, device)
        activations = None
        if device.type == "cuda":
            requested = limits.max_slots or MAX_GRAPH_BATCH
            rows = bucket_for(min(requested, MAX_GRAPH_BATCH)) if config.cuda_graph else requested
            graphed = GRAPHED_PREFILL_TOKENS if config.cuda_graph and config.world_size == 1 else 0
            activations = measure_activations(model, device, limits.max_batch_tokens, rows, graphed)
        local, memory = size_capacity(limits, model, device, config.rank, config.cuda_graph, activations)
    except Exception as exc:
        raise StartupFailure(phase, exc, epoch) from exc
    ready = Ready(local, str(device), os.getpid(), socket.gethostname(), challenge.nonce)
    sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, epoch, config.rank, 0, ready)))
    log.info("ready", capacity=local)

    try:
        phase = "startup:gate"
        epoch, decision = _wait_for(sock, config, epoch, (Go,), "Go or Cancel")
        if isinstance(decision, Cancel):
            log.warning("startup cancelled", reason=decision.reason)
            return EXIT_CANCELLED
        bind_epoch(epoch)
        effective: Capacity = decision.capacity
        if not (
            0 < effective.max_slots <= local.max_slots
            and 0 < effective.kv_pages <= local.kv_pages
            and effective.snapshot_slots <= local.snapshot_slots
        ):
            raise ValueError(f"effective capacity {effective} exceeds local capacity {local}")
        if config.rank == 0:
            context = min(model.config.max_position_embeddings, effective.kv_pages * effective.page_size)
            log.info("memory", plan=memory_line(effective, memory, model, config.cuda_graph, context))
        phase = "startup:dist_init"
        _init_distributed(config, decision, device)
        model.tp.enable_one_shot(model.dtype, device)
        phase = "startup:allocate"
        slots = state_slot_layout(effective.max_slots, config.cuda_graph, effective.snapshot_slots)
        model.allocate_cache(effective.kv_pages + 1, effective.page_size, slots.total)
        graphs = None
        if config.cuda_graph:
            phase = "startup:graphs"
            graphs = build_graph_runner(
                model, effective, device, rank=config.rank, world_size=config.world_size
            )
    except Exception as exc:
        raise StartupFailure(phase, exc, epoch) from exc
    runner = StepRunner(
        model,
        device,
        config.rank,
        effective.page_size,
        effective.kv_pages,
        effective.max_slots,
        effective.max_batch_tokens,
        SnapshotTable(slots.snapshot_base, slots.snapshot_slots),
    )
    runner.graphs = graphs
    if graphs is not None and config.world_size == 1:
        runner.prefill_graphs = PrefillGraphRunner(
            model,
            device,
            pad_slot=slots.prefill_padding,
            pad_page=effective.kv_pages,
            max_pages=graphs.geometry.max_pages,
        )
    if config.rank == 0:  # the rank that samples keeps the constrained requests' matchers
        runner.grammars = GrammarTable(config.model_dir, model.config.vocab_size, model.config.eos_token_ids)
    return runner, epoch


def run_worker(config: WorkerConfig) -> int:
    configure_logging(config.rank, config.epoch, config.log_level, config.log_format)
    # ps and top name the rank instead of multiprocessing's spawn command line
    setproctitle(f"phalanx rank {config.rank}/{config.world_size} ({Path(config.model_dir).name})")
    # tqdm's default lock is a multiprocessing semaphore, which a rank leaving through os._exit
    # leaks (the parent's resource tracker then warns); a rank's bars need only a thread lock.
    tqdm.set_lock(threading.RLock())
    identity = connection_identity(f"rank-{config.rank}")
    key = bytes.fromhex(config.auth_key) if config.auth_key else None
    framer = rank_authenticator(key, config.rank) if key else None  # the heartbeats' too
    # TCP (a key): frames signed, the connection encrypted, and a refused handshake watched for
    sock = wrap_socket(
        RankSocket(config.coordinator, identity, framer, rank_curve_options(key), HANDSHAKE_FAILED)
        if key
        else RankSocket(config.coordinator, identity),
        config.rank,
    )
    heartbeat: HeartbeatThread | None = None
    try:
        try:
            started = _startup(sock, config)
        except StartupFailure as exc:
            log.error("startup failed", phase=exc.phase, error=str(exc))
            failed = Failed("startup", str(exc), exc.phase, traceback.format_exc())
            sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, exc.epoch, config.rank, 0, failed)))
            return EXIT_POISONED
        if isinstance(started, int):
            return started
        runner, epoch = started
        if config.heartbeat_interval > 0:
            heartbeat = HeartbeatThread(
                config.coordinator,
                heartbeat_identity(identity),
                rank_curve_options(key) if key else {},
                config.rank,
                epoch,
                config.heartbeat_interval,
                framer,
                coordinator_grace_s=config.coordinator_grace,
            )
            heartbeat.start()
        loop = CommandLoop(sock, config.rank, epoch, runner)
        if runner.graphs is not None:
            prefill = runner.prefill_graphs
            on_finalize = prefill.capture if prefill is not None else None
            loop.register(Precapture, precapture_handler(runner.graphs, config.rank, on_finalize))
        code = loop.run()
        if runner.graphs is not None:
            runner.graphs.release()  # graphs hold the process group's collectives: drop them first
        if code == EXIT_OK and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return code
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        sock.close()
