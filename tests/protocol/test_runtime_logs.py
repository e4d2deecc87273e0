"""The log pipeline shared by the coordinator, the ranks and uvicorn: console lines (short,
aligned, rank as ``r0``, no epoch, no Python reprs) and JSON lines (every key), one record a line."""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest
import structlog

from phalanx.executor import logs as executor_logs
from phalanx.executor.config import ExecutorConfig
from phalanx.protocol.logs import ConsoleRenderer, configure_logging
from phalanx.protocol.messages import Capacity
from phalanx.worker import logs as worker_logs

CONSOLE_LINE = re.compile(r"^(DEBUG  |INFO   |WARNING|ERROR  ) \d\d-\d\d \d\d:\d\d:\d\d (r\d+ *|coord) \S")
CAPACITY = Capacity(kv_pages=512, page_size=16, max_slots=16, max_batch_tokens=2048)


@pytest.fixture
def captured(capsys: pytest.CaptureFixture[str]):
    structlog.reset_defaults()  # an earlier launch configured it
    yield capsys
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_console_rank_lines_are_short_aligned_and_free_of_reprs(captured: pytest.CaptureFixture[str]) -> None:
    worker_logs.configure_logging(rank=3, epoch=77)
    worker_logs.bind_seq(12)
    log = structlog.get_logger("t")
    log.info("ready", capacity=CAPACITY, dtype="torch.float32", seconds=0.0123456, path="/a b")
    log.warning("frame rejected", reason="unauthenticated")
    ready, rejected = captured.readouterr().err.splitlines()
    assert CONSOLE_LINE.match(ready) and CONSOLE_LINE.match(rejected), (ready, rejected)
    assert ready.startswith("INFO    ") and rejected.startswith("WARNING ")
    assert " r3    ready" in ready and "epoch" not in ready and "77" not in ready
    assert ready.index("seq=12") == rejected.index("seq=12")  # the keys start in one column
    assert ready.endswith(
        "seq=12 capacity={kv_pages=512 page_size=16 max_slots=16 max_batch_tokens=2048 snapshot_slots=0} "
        'dtype=torch.float32 seconds=0.01235 path="/a b"'
    )
    assert "Capacity(" not in ready and "'" not in ready


def test_coordinator_lines_carry_the_keys_even_from_unbound_threads(
    captured: pytest.CaptureFixture[str],
) -> None:
    executor_logs.configure_logging(log_format="json")
    executor_logs.bind(epoch=5, seq=9)
    structlog.get_logger("t").info("step", capacity=CAPACITY)
    thread = threading.Thread(target=lambda: structlog.get_logger("t").info("elsewhere"))
    thread.start()
    thread.join()
    step, elsewhere = (json.loads(line) for line in captured.readouterr().err.splitlines())
    assert step["rank"] == "coordinator" and step["epoch"] == 5 and step["seq"] == 9
    assert step["capacity"] == {
        "kv_pages": 512,
        "page_size": 16,
        "max_slots": 16,
        "max_batch_tokens": 2048,
        "snapshot_slots": 0,
    }
    assert step["event"] == "step" and step["level"] == "info" and step["timestamp"].endswith("Z")
    assert (elsewhere["rank"], elsewhere["epoch"], elsewhere["seq"]) == ("coordinator", None, None)


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_standard_library_records_share_the_format(
    captured: pytest.CaptureFixture[str], log_format: str
) -> None:
    executor_logs.configure_logging(log_format=log_format)
    structlog.get_logger("t").info("ours", n=1)
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
    logging.getLogger("uvicorn.error").debug("below the level")
    ours, theirs = captured.readouterr().err.splitlines()
    if log_format == "console":
        assert CONSOLE_LINE.match(ours) and CONSOLE_LINE.match(theirs)
        assert theirs.endswith(" coord Started server process [42]")
    else:
        record = json.loads(theirs)
        assert record["event"] == "Started server process [42]" and record["logger"] == "uvicorn.error"
        assert record["level"] == "info" and record["rank"] == "coordinator" and "timestamp" in record
        assert json.loads(ours)["n"] == 1


def test_an_exception_stays_one_json_record(captured: pytest.CaptureFixture[str]) -> None:
    executor_logs.configure_logging(log_format="json")
    try:
        raise ValueError("boom")
    except ValueError:
        structlog.get_logger("t").exception("step failed", request=7)
    (line,) = captured.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and record["request"] == 7
    assert "Traceback" in record["exception"] and "ValueError: boom" in record["exception"]


def test_console_values_render_without_python_reprs() -> None:
    render = ConsoleRenderer()
    line = render(
        None,
        "info",
        {"event": "x", "rank": 0, "flag": True, "none": None, "big": 123456.7, "ids": (1, 2), "q": "it's"},
    )
    assert line.endswith("""x                              flag=true none=- big=123457 ids=[1,2] q="it's\"""")


def test_unknown_formats_and_levels_are_refused() -> None:
    with pytest.raises(ValueError, match="log format must be one of console, json, got 'xml'"):
        configure_logging(log_format="xml")
    with pytest.raises(ValueError, match="log level must be one of debug, info, warning, error, got 'loud'"):
        configure_logging(level="loud")
    with pytest.raises(ValueError, match="log format must be one of console, json, got 'xml'"):
        ExecutorConfig(model_dir="m", log_format="xml")  # refused before a launch, configured or not


def test_the_cli_installs_its_log_flags_over_a_structlog_configured_before(
    captured: pytest.CaptureFixture[str],
) -> None:
    from structlog.testing import capture_logs

    from phalanx.tools.cli import main

    with capture_logs():  # leaves structlog configured, with its default pipeline on stdout
        pass
    argv = ["generate", "--tp", "1", "--prompt-ids", "5,6,7", "--max-tokens", "2", "--json"]
    assert main([*argv, "--verbose", "--log-format", "json"]) == 0
    out, err = captured.readouterr()
    assert json.loads(out)["finish_reason"] == "length"  # stdout holds the answer alone
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(record["event"] == "device auto: cpu" for record in records), (out, err)
