"""Failures through real rank processes: a rank SIGKILLed mid-step, a rank that never replies,
a rank that fails to load, a rank whose distributed init never completes.

Fault triggers use the test-only PHALANX_TEST_FAULT variable (see worker/faults.py); spawned
ranks inherit it from this process's environment.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from executor.errors import ExecutorPoisoned, StartupError
from executor.launcher import launch_executor
from tests.runtime_helpers import chunk, row, small_config


def _assert_gone(pids: list[int | None]) -> None:
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_rank_killed_mid_step_poisons_within_two_seconds(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("PHALANX_TEST_FAULT", "1:decode:hang")
    ex = launch_executor(small_config(tiny_model_dir, 2))
    try:
        (first,) = ex.prefill([chunk(1, 0, [5, 6, 7], 0, True)]).results
        pids = ex.rank_pids
        killed_at: list[float] = []

        def kill_rank_1() -> None:
            time.sleep(0.5)  # rank 1 is inside the decode by now (hung at its fault point)
            killed_at.append(time.monotonic())
            os.kill(pids[1], signal.SIGKILL)

        killer = threading.Thread(target=kill_rank_1)
        killer.start()
        with pytest.raises(
            ExecutorPoisoned, match=r"^executor is poisoned: rank 1 exited with code -9 during decode$"
        ):
            ex.decode([row(1, 0, 0, first.token, 3)])
        detected_after = time.monotonic() - killed_at[0]
        killer.join()
        assert detected_after < 2.0
        _assert_gone(pids)
        with pytest.raises(ExecutorPoisoned, match="rank 1 exited with code -9 during decode"):
            ex.ping()
    finally:
        ex.shutdown()


def test_rank_that_never_replies_poisons_at_the_step_timeout(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("PHALANX_TEST_FAULT", "0:ping#2:hang")  # ping 1 is the startup gate's
    ex = launch_executor(small_config(tiny_model_dir, 1, step_timeout=1.0))
    try:
        pids = ex.rank_pids
        started = time.monotonic()
        with pytest.raises(
            ExecutorPoisoned,
            match=r"^executor is poisoned: ping did not complete within 1 s: no reply from ranks \[0\]$",
        ):
            ex.ping()
        assert 1.0 <= time.monotonic() - started < 3.0
        _assert_gone(pids)
    finally:
        ex.shutdown()


def test_rank_that_fails_to_load_fails_startup_naming_rank_and_phase(
    tiny_model_dir: Path, monkeypatch
) -> None:
    monkeypatch.setenv("PHALANX_TEST_FAULT", "1:load:raise")
    with pytest.raises(StartupError, match=r"^rank 1 failed during startup:load: InjectedFault: ") as info:
        launch_executor(small_config(tiny_model_dir, 2))
    assert (info.value.rank, info.value.phase) == (1, "startup:load")
    codes = info.value.exit_codes
    assert sorted(codes) == [0, 1]
    assert all(code is not None and code != 0 for code in codes.values()), codes


def test_hung_distributed_init_aborts_within_the_watchdog_time(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("PHALANX_TEST_FAULT", "1:dist_init:hang")
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        launch_executor(small_config(tiny_model_dir, 2, dist_init_timeout=2.0, startup_timeout=60.0))
    elapsed = time.monotonic() - started
    assert info.value.phase == "startup:dist_init"
    assert f"rank {info.value.rank}" in str(info.value)
    # Rank 1 hung inside the watchdog: os.abort() (SIGABRT) is the only way it can have exited.
    assert info.value.exit_codes[1] == -signal.SIGABRT
    assert info.value.exit_codes[0] not in (None, 0)
    assert elapsed < 60.0  # long before the gate's own deadline
