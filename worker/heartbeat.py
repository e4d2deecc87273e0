"""Periodic Heartbeat frames from a rank the coordinator did not spawn (it cannot watch our pid).

The thread has its own socket (ZeroMQ sockets are not thread-safe) and keeps beating while the
main thread computes, so a silent rank is a dead or frozen process, not a busy one.
"""

from __future__ import annotations

import threading
import time

from protocol import PROTOCOL_VERSION, encode
from protocol.messages import Heartbeat, ReplyEnvelope
from protocol.transport import Framer, RankSocket


class HeartbeatThread:
    def __init__(
        self, address: str, rank: int, epoch: int, interval_s: float, framer: Framer | None = None
    ) -> None:
        self._address = address
        self._rank = rank
        self._epoch = epoch
        self._interval = interval_s
        self._framer = framer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="phalanx-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _beat(self) -> None:
        sock = RankSocket(self._address, f"heartbeat-{self._rank}".encode(), self._framer)
        try:
            while not self._stop.is_set():
                body = Heartbeat(time.time())
                sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, self._epoch, self._rank, 0, body)))
                self._stop.wait(self._interval)
        finally:
            sock.close(linger_ms=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)
