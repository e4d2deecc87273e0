"""Errors the executor raises to its caller (the scheduler)."""

from __future__ import annotations


class ExecutorError(Exception):
    """Base class of every executor error."""


class StepRejected(ExecutorError):
    """A command was structurally invalid and was refused before dispatch; nothing is poisoned."""


class ExecutorPoisoned(ExecutorError):
    """The replica failed; every call after the first failure raises this with the first reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"executor is poisoned: {reason}")
        self.reason = reason


class StartupError(ExecutorError):
    """The startup gate failed: a rank failed, exited or timed out. Every rank was stopped.

    ``rank`` is None when no single rank is to blame (for example a deadline with several silent).
    """

    def __init__(self, message: str, rank: int | None = None, phase: str = "startup") -> None:
        super().__init__(message)
        self.rank = rank
        self.phase = phase
        # Each spawned rank's exit code once every rank was stopped (None: not spawned here).
        self.exit_codes: dict[int, int | None] = {}


class ReplyError(ExecutorError):
    """A step's replies broke the reply contract (the text is asserted in tests)."""
