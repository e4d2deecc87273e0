"""The log line format every phalanx process writes: the coordinator, each rank and the HTTP server
share one stderr, so all of them render through the same structlog pipeline, in one of two formats.

- ``console`` (the default): one short aligned line per record for a person at a terminal::

      INFO    12-03 01:47:17 r0    ready                          capacity={kv_pages=512 page_size=16}

  The rank is ``r0``, ``r1`` …, the coordinator ``coord``; the launch epoch is left out (it is
  logged once at startup) and values are plain text, never Python reprs.
- ``json``: one JSON object per line with every key (timestamp in ISO 8601 UTC, level, rank,
  epoch, seq, event, logger for standard-library records), for log shippers.

Records of the standard ``logging`` module (uvicorn's among them) go through the same renderer.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
from structlog.types import EventDict, Processor

from phalanx.config.replica import LOG_FORMATS, LOG_LEVELS

_EVENT_WIDTH = 30
_HIDDEN_IN_CONSOLE = frozenset({"timestamp", "level", "rank", "epoch", "seq", "event", "logger"})


def _plain(value: Any) -> Any:
    """Structs, dataclasses, dtypes and paths as plain builtins (dicts, lists, strings, numbers)."""
    return msgspec.to_builtins(value, enc_hook=_last_resort)


def _last_resort(value: Any) -> str:
    text = str(value)
    return text.removeprefix("torch.")  # torch.float32 -> float32


def _console_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "-"
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0 or abs(value) >= 1e4:
            return f"{value:.0f}" if math.isfinite(value) else str(value)
        return f"{value:.4g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        needs_quotes = not value or any(c.isspace() or c in "\"'=" for c in value)
        return msgspec.json.encode(value).decode() if needs_quotes else value
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}={_console_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_console_value(v) for v in value) + "]"
    return _console_value(_plain(value))


def _who(rank: Any) -> str:
    if isinstance(rank, int) and not isinstance(rank, bool):
        return f"r{rank}"
    return "coord"


class ConsoleRenderer:
    """``LEVEL MM-DD HH:MM:SS WHO event  key=value …`` with the event padded so keys line up."""

    def __call__(self, _logger: object, _name: str, event_dict: EventDict) -> str:
        level = str(event_dict.get("level", "info")).upper()
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(event_dict.get("_created", time.time())))
        head = f"{level:<7} {stamp} {_who(event_dict.get('rank')):<5} "
        event = str(event_dict.get("event", ""))
        fields = [
            f"{key}={_console_value(value)}"
            for key, value in event_dict.items()
            if key not in _HIDDEN_IN_CONSOLE and not key.startswith("_")
        ]
        seq = event_dict.get("seq")
        if isinstance(seq, int) and seq > 0:  # the step a rank is on, when it is on one
            fields.insert(0, f"seq={seq}")
        line = head + (f"{event:<{_EVENT_WIDTH}} " + " ".join(fields) if fields else event)
        exception = event_dict.get("exception")
        return f"{line.rstrip()}\n{exception}" if exception else line.rstrip()


def _json_renderer(_logger: object, _name: str, event_dict: EventDict) -> str:
    event_dict.pop("_created", None)
    return msgspec.json.encode(event_dict, enc_hook=_last_resort).decode()


def _timestamps(_logger: object, _name: str, event_dict: EventDict) -> EventDict:
    now = datetime.now(UTC)
    event_dict["_created"] = now.timestamp()
    event_dict["timestamp"] = now.isoformat(timespec="microseconds").replace("+00:00", "Z")
    return event_dict


def _coordinator_defaults(_logger: object, _name: str, event_dict: EventDict) -> EventDict:
    """Lines from coordinator threads that never bound a step still carry the keys."""
    event_dict.setdefault("rank", "coordinator")
    event_dict.setdefault("epoch", None)
    event_dict.setdefault("seq", None)
    return event_dict


def _foreign_event(_logger: object, _name: str, event_dict: EventDict) -> EventDict:
    """A standard-library record: its message is the event, its logger name is kept."""
    record = event_dict.get("_record")
    if record is not None:
        event_dict["logger"] = record.name
        event_dict["level"] = record.levelname.lower()
    return event_dict


class _CurrentStderr:
    """Writes each line to whatever ``sys.stderr`` is at that moment: a stream captured at
    configuration time can be closed later (pytest's capture fixtures swap and close it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on the current ``sys.stderr``; it writes each record in one call, so lines
    of processes that share the stream do not interleave."""

    def __init__(self) -> None:
        super().__init__(_CurrentStderr())


def renderer_for(log_format: str) -> Callable[..., str]:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    return ConsoleRenderer() if log_format == "console" else _json_renderer


def level_number(level: str) -> int:
    number = logging.getLevelNamesMapping().get(level.upper())
    if number is None:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return number


def configure_logging(level: str = "info", log_format: str = "console", *, coordinator: bool = True) -> None:
    """Install the pipeline for structlog and for the standard ``logging`` module (uvicorn, …).

    A rank passes ``coordinator=False`` and binds its own rank, epoch and seq as context vars."""
    renderer = renderer_for(log_format)
    number = level_number(level)
    shared: list[Processor] = [structlog.contextvars.merge_contextvars]
    if coordinator:
        shared.append(_coordinator_defaults)
    shared += [structlog.processors.add_log_level, _timestamps]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.WriteLoggerFactory(_CurrentStderr()),  # one write per line
        cache_logger_on_first_use=False,
    )
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                _foreign_event,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
