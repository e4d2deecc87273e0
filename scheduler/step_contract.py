"""What the scheduler needs of the executor: its capacity, and one pair of calls per step.

``send(command)`` sends a command to every rank and returns a handle without waiting;
``collect(handle)`` returns the step's reply, already checked against the command (one token per
decode row and per last prompt chunk), or raises. Several steps may be in flight; they are
collected in the order they were sent. ``executor.runtime.Executor`` is such an executor.
"""

from __future__ import annotations

from typing import Any, Protocol

from phalanx.protocol.messages import Capacity, Command, Reply


class StepExecutor(Protocol):
    @property
    def capacity(self) -> Capacity: ...

    def send(self, command: Command) -> Any: ...

    def collect(self, in_flight: Any) -> Reply: ...
