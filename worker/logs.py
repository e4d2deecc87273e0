"""Logs of a rank: every line carries rank, epoch and seq (bound as context vars), rendered in the
format shared with the coordinator (``protocol.logs``)."""

from __future__ import annotations

import structlog

from phalanx.protocol.logs import configure_logging as _configure


def configure_logging(rank: int, epoch: int, level: str = "info", log_format: str = "console") -> None:
    _configure(level, log_format, coordinator=False)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(rank=rank, epoch=epoch, seq=0)


def bind_seq(seq: int) -> None:
    structlog.contextvars.bind_contextvars(seq=seq)


def bind_epoch(epoch: int) -> None:
    structlog.contextvars.bind_contextvars(epoch=epoch)
