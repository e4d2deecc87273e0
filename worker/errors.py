"""Errors a worker raises while checking a command against its local state."""

from __future__ import annotations


class WorkerStateError(Exception):
    """The command disagrees with this rank's state (unknown request, slot owner, phase).

    The coordinator and the rank have diverged; the rank poisons itself.
    """
