"""The coordinator's view of one rank: how to address it, how to notice it died, how to stop it.

A rank the coordinator spawned is watched through its process sentinel (a file descriptor that
becomes readable when the process exits) and can be killed. A rank started elsewhere (torchrun,
SLURM) is watched through its heartbeats; it cannot be killed from here, only told to stop.
"""

from __future__ import annotations

import time
from multiprocessing.process import BaseProcess


class RankHandle:
    def __init__(self, rank: int, process: BaseProcess | None = None) -> None:
        self.rank = rank
        self.process = process
        self.identity: bytes | None = None  # learned from the rank's Ready frame
        self.last_heard = time.monotonic()

    @property
    def local(self) -> bool:
        return self.process is not None

    @property
    def sentinel(self) -> int | None:
        return self.process.sentinel if self.process is not None else None

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def death(self, heartbeat_timeout: float) -> str | None:
        """Why this rank counts as dead, or None while it is alive."""
        if self.process is not None:
            code = self.process.exitcode
            return None if code is None else f"rank {self.rank} exited with code {code}"
        silent = time.monotonic() - self.last_heard
        if silent > heartbeat_timeout:
            return f"rank {self.rank} sent no heartbeat for {silent:.1f} s"
        return None

    def kill(self) -> None:
        if self.process is not None and self.process.exitcode is None:
            self.process.kill()

    def join(self, timeout: float) -> bool:
        """Wait for a local rank to exit; True when it has (always True for a remote rank)."""
        if self.process is None:
            return True
        self.process.join(timeout)
        return self.process.exitcode is not None

    @property
    def exitcode(self) -> int | None:
        return None if self.process is None else self.process.exitcode
