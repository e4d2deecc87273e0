"""Periodic Heartbeat frames from a rank the coordinator did not spawn (it cannot watch our pid),
and the other direction: such a rank leaves on its own when its coordinator is gone.

The thread has its own socket (ZeroMQ sockets are not thread-safe) and keeps beating while the
main thread computes, so a silent rank is a dead or frozen process, not a busy one. It also
watches that socket's connection (ZMTP heartbeats catch a peer host that vanished without closing
the connection): disconnected for longer than ``coordinator_grace_s`` means the coordinator is
gone, and the rank exits, even from inside a wedged collective, rather than linger forever. Not
yet connected counts as disconnected: the thread starts once the coordinator has started the
rank, so a coordinator that dies before this socket ever connects leaves the rank orphaned too
(a CI run saw a rank outlive its killed coordinator by over 15 s that way).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from phalanx.protocol import PROTOCOL_VERSION, encode
from phalanx.protocol.messages import Heartbeat, ReplyEnvelope
from phalanx.protocol.transport import Framer, RankSocket, SocketOptions

log = structlog.get_logger("phalanx.worker")

EXIT_ORPHANED = 4


class HeartbeatThread:
    def __init__(
        self,
        address: str,
        identity: bytes,
        socket_options: SocketOptions,
        rank: int,
        epoch: int,
        interval_s: float,
        framer: Framer | None = None,
        coordinator_grace_s: float = 10.0,
    ) -> None:
        self._address = address
        self._identity = identity  # heartbeat_identity() of the rank's bound command connection
        self._socket_options = socket_options  # CURVE's on TCP
        self._rank = rank
        self._epoch = epoch
        self._interval = interval_s
        self._framer = framer
        self._grace = coordinator_grace_s
        self._stop = threading.Event()
        context = contextvars.copy_context()  # log lines keep the rank/epoch/seq context
        self._thread = threading.Thread(
            target=context.run, args=(self._beat,), name="phalanx-heartbeat", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _beat(self) -> None:
        # ZMTP pings notice a coordinator host that vanished without closing the connection.
        options = {zmq.HEARTBEAT_IVL: 1000, zmq.HEARTBEAT_TIMEOUT: 3000, **self._socket_options}
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        sock = RankSocket(self._address, self._identity, self._framer, options, events)
        monitor = sock.monitor
        disconnected_since: float | None = time.monotonic()  # until the first connection
        try:
            while not self._stop.is_set():
                body = Heartbeat(time.time())
                # Nobody to send to right now: not an error, the connection watch below decides.
                with contextlib.suppress(zmq.Again):
                    frame = encode(ReplyEnvelope(PROTOCOL_VERSION, self._epoch, self._rank, 0, body))
                    sock.send(frame, block=False)
                while monitor.poll(0):
                    event = recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_DISCONNECTED and disconnected_since is None:
                        disconnected_since = time.monotonic()
                    elif event == zmq.EVENT_CONNECTED:
                        disconnected_since = None
                if disconnected_since is not None and time.monotonic() - disconnected_since > self._grace:
                    log.critical("coordinator unreachable; exiting", grace_s=self._grace)
                    sys.stderr.flush()
                    os._exit(EXIT_ORPHANED)
                self._stop.wait(self._interval)
        finally:
            sock.close(linger_ms=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)
