"""ZeroMQ sockets between the coordinator and its ranks, and where their addresses live.

Topology: the coordinator binds one ROUTER socket; every rank connects one DEALER socket with a
random identity (and, when it sends heartbeats, a second DEALER on its own thread, whose identity
is :func:`heartbeat_identity` of the first). The coordinator learns which identity is which rank
from the rank's signed handshake (Hello, then a Ready that echoes the connection's Challenge),
then addresses that rank's commands to it alone and counts that rank's heartbeats only from the
heartbeat identity of that bound connection.

Addresses are ``ipc://`` paths in a private 0700 runtime directory by default (removed on exit),
or ``tcp://host:port`` when ranks run on other machines.

Every payload passes through one :class:`Framer` on its way out (``seal``) and in (``open``).
The default framer is the identity; an authenticating framer (HMAC for TCP) plugs in there.

On TCP the connections are also encrypted with ZeroMQ's CURVE (:func:`curve_server_options`,
:func:`curve_client_options`): the coordinator is the CURVE server, each rank a client with a
throwaway keypair that trusts the coordinator's public key. A peer that does not complete the
CURVE handshake with that key never delivers a frame; both sides see the failed handshake in
their socket's monitor (:meth:`CoordinatorSocket.handshake_failures`,
:meth:`RankSocket.handshake_failed`).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile

import zmq
from zmq.utils.monitor import recv_monitor_message

from phalanx.protocol.errors import ProtocolError

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL on Linux.
_MAX_IPC_PATH = 107


class Framer:
    """Turns one payload into the frames that travel, and back. Identity by default."""

    def seal(self, payload: bytes) -> list[bytes]:
        return [payload]

    def open(self, frames: list[bytes], peer: bytes = b"") -> bytes:
        """``peer``: the sender's identity, where the socket knows it (a ROUTER)."""
        if len(frames) != 1:
            raise ProtocolError(ProtocolError.UNDECODABLE, f"expected 1 frame, got {len(frames)}")
        return frames[0]


_PREFIX = "phalanx-"
_OWNER = "owner.pid"


class RuntimeDir:
    """A private (mode 0700) directory for ipc sockets; removed by :meth:`remove` or at exit.

    It names its owner's pid, so that a later one removes the directories of owners that died
    without removing theirs (a SIGKILL): see :func:`sweep_dead_runtime_dirs`."""

    def __init__(self) -> None:
        sweep_dead_runtime_dirs()
        self.path = tempfile.mkdtemp(prefix=_PREFIX)
        os.chmod(self.path, 0o700)
        with open(os.path.join(self.path, _OWNER), "w") as owner:
            owner.write(str(os.getpid()))
        atexit.register(self.remove)

    def ipc_address(self, name: str = "control") -> str:
        path = f"{os.path.join(self.path, name)}.sock"
        if len(path) > _MAX_IPC_PATH:
            raise ValueError(
                f"ipc socket path {path!r} is longer than {_MAX_IPC_PATH} bytes; set TMPDIR shorter"
            )
        return f"ipc://{path}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def sweep_dead_runtime_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's runtime directories whose owner process is gone; returns their paths.
    A directory without an owner file, or whose owner still runs, is left alone."""
    parent = parent or tempfile.gettempdir()
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith(_PREFIX):
            continue
        try:  # another process may remove it meanwhile
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER)) as owner:
                pid = int(owner.read())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


SocketOptions = dict[int, int | bytes]

# A CURVE handshake that failed: at the server, a peer with another key (or none), at a client, a
# server that refused it. Monitors report them with a ZMTP error code as the event's value.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
WRONG_KEY = zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC  # the peer's CURVE boxes do not open: another key


def curve_server_options(secret_key: bytes) -> SocketOptions:
    """The coordinator's side of CURVE: ``secret_key`` is its long-term secret key (Z85)."""
    return {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: secret_key}


def curve_client_options(server_public_key: bytes) -> SocketOptions:
    """A rank's side of CURVE: trust ``server_public_key`` (Z85); the rank's own keypair is made
    for this connection, since the coordinator knows ranks by their signed handshake, not a key."""
    public, secret = zmq.curve_keypair()
    return {zmq.CURVE_SERVERKEY: server_public_key, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}


def _drain_monitor(monitor: zmq.Socket) -> list[tuple[int, int]]:
    """The (event, value) pairs a monitor socket holds now, without waiting."""
    events = []
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        events.append((event["event"], event["value"]))
    return events


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class CoordinatorSocket:
    """The coordinator's ROUTER: ``send(identity, payload)`` and ``recv(timeout)``."""

    def __init__(
        self, address: str, framer: Framer | None = None, options: SocketOptions | None = None
    ) -> None:
        """``options``: extra ZeroMQ socket options set before binding (CURVE's, on TCP)."""
        self._context = zmq.Context.instance()
        self._framer = framer or Framer()
        self.socket = _socket(self._context, zmq.ROUTER)
        # A send to a peer that is gone raises instead of being dropped silently. A second peer
        # with an identity already connected is refused (no handover): nobody takes over a rank.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        for option, value in (options or {}).items():
            self.socket.setsockopt(option, value)
        encrypted = bool((options or {}).get(zmq.CURVE_SERVER))
        self._monitor = self.socket.get_monitor_socket(HANDSHAKE_FAILED) if encrypted else None
        self.socket.bind(address)
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, identity: bytes, payload: bytes) -> None:
        self.socket.send_multipart([identity, *self._framer.seal(payload)], copy=False)

    def recv(self, timeout_s: float) -> tuple[bytes, bytes] | None:
        """One (identity, payload), or None when nothing arrives within ``timeout_s``."""
        if not self.socket.poll(max(0, int(timeout_s * 1000))):
            return None
        return self.recv_ready()

    def recv_ready(self) -> tuple[bytes, bytes]:
        """Receive a message known to be waiting; raises ProtocolError (its ``peer`` set) for a bad
        framing."""
        identity, *frames = self.socket.recv_multipart()
        try:
            return identity, self._framer.open(frames, identity)
        except ProtocolError as exc:
            exc.peer = identity
            raise

    def handshake_failures(self) -> list[int]:
        """The ZMTP error codes of the CURVE handshakes that failed since the last call (never
        blocks; always empty on an unencrypted socket)."""
        if self._monitor is None:
            return []
        return [value for _event, value in _drain_monitor(self._monitor)]

    def close(self) -> None:
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
        self.socket.close(linger=0)


class RankSocket:
    """A rank's DEALER connected to the coordinator."""

    def __init__(
        self,
        address: str,
        identity: bytes,
        framer: Framer | None = None,
        options: SocketOptions | None = None,
        monitor_events: int = 0,
    ) -> None:
        """``options``: extra ZeroMQ socket options, set before connecting. ``monitor_events``: a
        mask of ``zmq.EVENT_*`` to report on ``self.monitor`` (a PAIR socket), watched from before
        the connect, so that the first connection's events cannot be missed."""
        self._context = zmq.Context.instance()
        self._framer = framer or Framer()
        self.socket = _socket(self._context, zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity)
        for option, value in (options or {}).items():
            self.socket.setsockopt(option, value)
        self.monitor = self.socket.get_monitor_socket(monitor_events) if monitor_events else None
        self.socket.connect(address)

    def send(self, payload: bytes, block: bool = True) -> None:
        """Queue ``payload``; with ``block`` False, raise ``zmq.Again`` instead of waiting."""
        self.socket.send_multipart(self._framer.seal(payload), 0 if block else zmq.NOBLOCK, copy=False)

    def recv(self, timeout_s: float | None) -> bytes | None:
        """One payload, or None on timeout (``timeout_s`` None waits forever)."""
        if timeout_s is not None and not self.socket.poll(max(0, int(timeout_s * 1000))):
            return None
        return self._framer.open(self.socket.recv_multipart())

    def handshake_failed(self) -> bool:
        """Whether the coordinator refused this socket's CURVE handshake since the last call (it
        must be monitoring HANDSHAKE_FAILED; other monitored events are consumed too)."""
        if self.monitor is None:
            return False
        return any(event & HANDSHAKE_FAILED for event, _value in _drain_monitor(self.monitor))

    def has_message(self) -> bool:
        """Whether a payload is waiting (never blocks)."""
        return bool(self.socket.poll(0))

    def close(self, linger_ms: int = 2000) -> None:
        """Close, giving queued replies (a final Failed or Ack) time to leave; the monitor too."""
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.socket.close(linger=linger_ms)


def connection_identity(name: str) -> bytes:
    """A ZeroMQ identity no other peer can guess: ``name`` plus 64 random bits. The coordinator
    routes to a rank by the identity its signed handshake came from, never by a claimed name."""
    return f"{name}-{secrets.token_hex(8)}".encode()


def heartbeat_identity(identity: bytes) -> bytes:
    """The identity of a rank's heartbeat socket, given that of its command socket: a heartbeat
    counts only from the heartbeat connection of the connection the rank's handshake bound."""
    return identity + b"/heartbeat"


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"
