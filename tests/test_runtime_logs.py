"""Every log line carries rank, epoch and seq, on ranks and on the coordinator."""

from __future__ import annotations

import threading

import pytest
import structlog

from executor import logs as executor_logs
from worker import logs as worker_logs


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(executor_logs, "_configured", False)  # an earlier launch configured it
    yield capsys
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    monkeypatch.setattr(executor_logs, "_configured", False)


def test_rank_lines_carry_rank_epoch_and_seq(captured: pytest.CaptureFixture[str]) -> None:
    worker_logs.configure_logging(rank=3, epoch=77)
    worker_logs.bind_seq(12)
    structlog.get_logger("t").info("hello")
    line = captured.readouterr().err
    assert "rank=3" in line and "epoch=77" in line and "seq=12" in line and "event='hello'" in line


def test_coordinator_lines_carry_the_keys_even_from_unbound_threads(
    captured: pytest.CaptureFixture[str],
) -> None:
    structlog.reset_defaults()
    executor_logs.configure_logging()
    executor_logs.bind(epoch=5, seq=9)
    structlog.get_logger("t").info("step")
    thread = threading.Thread(target=lambda: structlog.get_logger("t").info("elsewhere"))
    thread.start()
    thread.join()
    step, elsewhere = captured.readouterr().err.splitlines()
    assert "rank='coordinator'" in step and "epoch=5" in step and "seq=9" in step
    assert "rank='coordinator'" in elsewhere and "epoch=None" in elsewhere and "seq=None" in elsewhere
