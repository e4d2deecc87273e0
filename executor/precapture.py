"""The decode graph pre-capture sweep, driven from the coordinator through the normal dispatch.

Each phase is one ``Precapture`` command sent to every rank and answered with ``Ack`` by every
rank, so each phase is a barrier: no rank starts capturing a bucket before every rank finished
the warm-up, and no rank launches a bucket's graph before every rank finished capturing it. That
split matters under tensor parallelism: the first launch of a captured collective blocks on its
peers, and overlapping it with a peer still capturing or instantiating deadlocks the driver.

Order: ``Warmup`` (one eager all-reduce per bucket size: a collective must never connect lazily
inside a capture), then for every bucket, largest first (so smaller graphs reuse the memory pool
of larger ones), ``Capture(b)`` then ``Launch(b)``, then ``Finalize`` (each rank checks that every
bucket is captured: ``decode graph pre-capture left bucket {b} uncaptured``).

The sweep runs under a watchdog (600 s by default). A wedged NCCL cannot be unwound, and the
normal exit path would take the same wedged driver lock, so on expiry the watchdog logs and
aborts the process. A phase that fails (a ``Failed`` reply, a dead or silent rank) raises from the
dispatch, which has already poisoned the executor and killed every rank; nothing is left that can
wedge, so the watchdog is disarmed then and the error propagates.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
from tqdm import tqdm

from phalanx.executor.errors import ExecutorError, StartupError
from phalanx.executor.runtime import Executor
from phalanx.protocol.buckets import buckets_up_to
from phalanx.protocol.messages import Capture, Finalize, Launch, Precapture, PrecapturePhase, Warmup

log = structlog.get_logger("phalanx.precapture")

PRECAPTURE_TIMEOUT_S = 600.0


def sweep_phases(buckets: Sequence[int]) -> list[PrecapturePhase]:
    """The phases of one sweep over ``buckets``, in the order they are sent."""
    phases: list[PrecapturePhase] = [Warmup()]
    for bucket in sorted(buckets, reverse=True):
        phases += [Capture(bucket=bucket), Launch(bucket=bucket)]
    phases.append(Finalize())
    return phases


class Watchdog:
    """Calls ``on_expiry`` (``os.abort`` by default) unless disarmed within ``timeout_s``."""

    def __init__(self, timeout_s: float, message: str, on_expiry: Callable[[], object] = os.abort) -> None:
        self.timeout_s = timeout_s
        self.message = message
        self._on_expiry = on_expiry
        self._disarmed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="phalanx-precapture-watchdog", daemon=True)

    def arm(self) -> Watchdog:
        self._thread.start()
        return self

    def disarm(self) -> None:
        self._disarmed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        if self._disarmed.wait(self.timeout_s):
            return
        log.critical(self.message)
        print(self.message, flush=True)
        self._on_expiry()


@dataclass
class SweepReport:
    buckets: tuple[int, ...]
    seconds: float
    phase_seconds: list[tuple[str, float]] = field(default_factory=list)


def phase_name(phase: PrecapturePhase) -> str:
    bucket = getattr(phase, "bucket", None)
    return type(phase).__name__ if bucket is None else f"{type(phase).__name__}({bucket})"


def run_precapture_sweep(
    send: Callable[[PrecapturePhase], object],
    buckets: Sequence[int],
    *,
    timeout_s: float = PRECAPTURE_TIMEOUT_S,
    on_expiry: Callable[[], object] = os.abort,
    progress: bool = True,
) -> SweepReport:
    """Send every phase through ``send`` (one barrier each) and return what it took.

    ``send(phase)`` dispatches ``Precapture(phase)`` to every rank and returns once every rank
    acknowledged; it raises (having poisoned the executor and stopped every rank) otherwise.
    """
    if not buckets:
        raise ValueError("pre-capture sweep needs at least one bucket")
    message = (
        f"decode graph pre-capture did not complete within {timeout_s:g}s — NCCL wedge suspected, aborting"
    )
    watchdog = Watchdog(timeout_s, message, on_expiry).arm()
    report = SweepReport(buckets=tuple(sorted(buckets)), seconds=0.0)
    started = time.perf_counter()
    phases = sweep_phases(buckets)
    phase = phases[0]
    try:
        with tqdm(
            total=len(phases), desc="capturing decode graphs", unit="phase", disable=not progress
        ) as bar:
            for phase in phases:
                bar.set_postfix_str(phase_name(phase))
                phase_started = time.perf_counter()
                send(phase)
                report.phase_seconds.append((phase_name(phase), time.perf_counter() - phase_started))
                bar.update(1)
    except BaseException as exc:
        log.error("decode graph pre-capture failed", phase=phase_name(phase), error=str(exc))
        raise
    finally:
        watchdog.disarm()
    report.seconds = time.perf_counter() - started
    log.info(
        f"decode graph pre-capture: buckets up to {max(buckets)} captured per rank in {report.seconds:.2f}s",
        buckets=list(report.buckets),
    )
    return report


def precapture_decode_graphs(executor: Executor, progress: bool = True) -> SweepReport:
    """The launcher's step after startup in graph mode: sweep every bucket up to
    ``bucket_for(effective max_slots)`` on every rank. A failure is raised as a StartupError that
    names the phase; the launcher stops every rank on any way out of it."""
    buckets = buckets_up_to(executor.capacity.max_slots)
    try:
        return run_precapture_sweep(
            lambda phase: executor.call(Precapture(phase)),
            buckets,
            timeout_s=executor.config.precapture_timeout,
            progress=progress,
        )
    except ExecutorError as exc:
        raise StartupError(f"decode graph pre-capture failed: {exc}", phase="startup:precapture") from exc
