"""Structured logs for the coordinator: every line carries rank ("coordinator"), epoch and seq."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def _defaults(_logger: object, _name: str, event: dict) -> dict:
    """Lines from threads that never bound a step still carry the three keys."""
    event.setdefault("rank", "coordinator")
    event.setdefault("epoch", None)
    event.setdefault("seq", None)
    return event


class _CurrentStderr:
    """Writes each line to whatever ``sys.stderr`` is at that moment: a stream captured at
    configuration time can be closed later (pytest's capture fixtures swap and close it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info") -> None:
    """Install the key=value renderer once; later calls keep the first configuration."""
    global _configured
    if _configured or structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _defaults,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.KeyValueRenderer(
                key_order=["timestamp", "level", "rank", "epoch", "seq", "event"]
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(_CurrentStderr()),  # one write per line
    )
    _configured = True


def bind(epoch: int, seq: int) -> None:
    structlog.contextvars.bind_contextvars(rank="coordinator", epoch=epoch, seq=seq)
