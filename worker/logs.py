"""Structured logs for a rank: every line carries rank, epoch and seq (bound as context vars)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(rank: int, epoch: int, level: str = "info") -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.KeyValueRenderer(
                key_order=["timestamp", "level", "rank", "epoch", "seq", "event"]
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),  # one write per line: ranks share stderr
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(rank=rank, epoch=epoch, seq=0)


def bind_seq(seq: int) -> None:
    structlog.contextvars.bind_contextvars(seq=seq)


def bind_epoch(epoch: int) -> None:
    structlog.contextvars.bind_contextvars(epoch=epoch)
