"""The pre-capture sweep's choreography and watchdog, coordinator side (no rank processes)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from phalanx.executor.precapture import Watchdog, phase_name, run_precapture_sweep, sweep_phases
from phalanx.protocol.messages import Capture, Finalize, Launch, Warmup


def test_phases_are_warmup_then_capture_launch_per_bucket_largest_first_then_finalize() -> None:
    assert sweep_phases([1, 2, 4]) == [
        Warmup(),
        Capture(bucket=4),
        Launch(bucket=4),
        Capture(bucket=2),
        Launch(bucket=2),
        Capture(bucket=1),
        Launch(bucket=1),
        Finalize(),
    ]


def test_sweep_sends_each_phase_once_and_reports_timings() -> None:
    sent: list[str] = []
    report = run_precapture_sweep(lambda phase: sent.append(phase_name(phase)), [1, 2], progress=False)
    assert sent == ["Warmup", "Capture(2)", "Launch(2)", "Capture(1)", "Launch(1)", "Finalize"]
    assert [name for name, _ in report.phase_seconds] == sent
    assert report.buckets == (1, 2) and report.seconds >= 0


def test_a_failing_phase_stops_the_sweep_and_disarms_the_watchdog() -> None:
    sent: list[str] = []
    expired = threading.Event()

    def send(phase: object) -> None:
        sent.append(phase_name(phase))
        if isinstance(phase, Capture) and phase.bucket == 2:
            raise RuntimeError("rank 1 failed during precapture: boom")

    with pytest.raises(RuntimeError, match="rank 1 failed during precapture"):
        run_precapture_sweep(send, [1, 2, 4], timeout_s=0.3, on_expiry=expired.set, progress=False)
    assert sent == ["Warmup", "Capture(4)", "Launch(4)", "Capture(2)"]
    time.sleep(0.5)
    assert not expired.is_set()


def test_watchdog_fires_when_a_phase_hangs() -> None:
    expired = threading.Event()
    release = threading.Event()

    def send(phase: object) -> None:
        if isinstance(phase, Launch):
            release.wait(5)  # a silent rank: the phase never completes on its own

    def on_expiry() -> None:
        expired.set()
        release.set()

    run_precapture_sweep(send, [1], timeout_s=0.2, on_expiry=on_expiry, progress=False)
    assert expired.is_set()


def test_watchdog_disarmed_in_time_does_not_fire() -> None:
    fired = threading.Event()
    dog = Watchdog(0.2, "never", fired.set).arm()
    dog.disarm()
    time.sleep(0.3)
    assert not fired.is_set()


def test_watchdog_aborts_the_process_on_expiry() -> None:
    code = (
        "import time\n"
        "from executor.precapture import run_precapture_sweep\n"
        "run_precapture_sweep(lambda phase: time.sleep(30), [1], timeout_s=0.3, progress=False)\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -6  # SIGABRT from os.abort
    assert time.monotonic() - started < 20
    assert (
        "decode graph pre-capture did not complete within 0.3s — NCCL wedge suspected, aborting"
        in proc.stdout
    )
