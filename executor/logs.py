"""Logs of the coordinator: every line carries rank ("coordinator"), epoch and seq, rendered in the
format shared with the ranks (``protocol.logs``)."""

from __future__ import annotations

import structlog

from phalanx.protocol.logs import configure_logging as _configure


def configure_logging(level: str = "info", log_format: str = "console") -> None:
    """Install the pipeline unless structlog is configured already: a launch from Python keeps
    its caller's logging. The CLI installs it with its flags unconditionally
    (``protocol.logs.configure_logging``), whatever configured structlog before."""
    if not structlog.is_configured():
        _configure(level, log_format)


def bind(epoch: int, seq: int) -> None:
    structlog.contextvars.bind_contextvars(rank="coordinator", epoch=epoch, seq=seq)
