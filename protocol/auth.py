"""Frame authentication for the TCP control plane: HMAC-SHA256 under a per-launch key.

An authenticated frame is::

    version (1 byte) | sender (uint32 LE) | counter (uint64 LE) | payload | HMAC-SHA256 tag (32 bytes)

The tag covers everything before it. ``sender`` is a rank, or :data:`COORDINATOR`; ``counter``
grows by one per frame a sender signs. A receiver accepts only the senders it expects (a rank
never accepts a frame signed by a rank, so a reply cannot be reflected back as a command) and
keeps, per sender and connection, a sliding window of the counters it has seen: a counter seen
before, or older than the window, is a replay and is dropped.

Spawned ranks get a fresh random key per launch (:func:`new_key`), so frames recorded in one
launch never verify in another. Ranks started elsewhere (torchrun, SLURM) derive the key from the
shared secret in ``PHALANX_SECRET`` (:func:`key_from_secret`); they cannot know the launch before
its Go, so a frame of an earlier launch is refused by its foreign epoch instead.
Every rejected frame raises ``ProtocolError(UNAUTHENTICATED)`` and is counted in ``drops``; the
receiver logs it at a bounded rate (``protocol.rejections``).

The same key also encrypts the connections (ZeroMQ CURVE, ``protocol.transport``): the
coordinator's CURVE keypair is derived from it (:func:`coordinator_curve_options`), so a rank that
holds the key, or the shared secret it comes from, trusts the right public key and needs no other
key material (:func:`rank_curve_options`). A peer with another secret cannot complete the
handshake; one without CURVE cannot connect at all.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import secrets
import struct
import threading
from collections.abc import Iterable

import zmq
from zmq.utils import z85

from phalanx.config import settings
from phalanx.protocol.errors import ProtocolError
from phalanx.protocol.transport import Framer, SocketOptions, curve_client_options, curve_server_options

AUTH_VERSION = 1
COORDINATOR = 0xFFFFFFFF
KEY_BYTES = 32
TAG_BYTES = 32
REPLAY_WINDOW = 4096
SECRET_ENV = settings.SECRET  # named in the errors of a secret that differs

_HEADER = struct.Struct("<BIQ")
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1
OVERHEAD = _HEADER.size + TAG_BYTES


def new_key() -> bytes:
    """A fresh random key for one launch."""
    return secrets.token_bytes(KEY_BYTES)


def key_from_secret(secret: bytes) -> bytes:
    """The control-plane key of ranks started elsewhere, which share only ``secret``."""
    _check_secret(secret)
    return hmac.digest(secret, b"phalanx control key", "sha256")


def _check_secret(secret: bytes) -> None:
    if len(secret) < 16:
        raise ValueError(f"the shared secret has {len(secret)} bytes; at least 16 are required")


def curve_server_secret_key(key: bytes) -> bytes:
    """The coordinator's CURVE secret key (Z85) for the control plane under ``key``."""
    return z85.encode(hmac.digest(key, b"phalanx curve server", "sha256"))


def coordinator_curve_options(key: bytes) -> SocketOptions:
    """The coordinator's socket options: the CURVE server with the keypair derived from ``key``."""
    return curve_server_options(curve_server_secret_key(key))


def rank_curve_options(key: bytes) -> SocketOptions:
    """A rank's socket options: a CURVE client that trusts the public key derived from ``key``."""
    return curve_client_options(zmq.curve_public(curve_server_secret_key(key)))


def coordinator_authenticator(key: bytes, world_size: int) -> FrameAuthenticator:
    """The coordinator signs as COORDINATOR and accepts ranks 0..world_size-1."""
    return FrameAuthenticator(key, COORDINATOR, accept=range(world_size))


def rank_authenticator(key: bytes, rank: int) -> FrameAuthenticator:
    """A rank signs as itself and accepts only the coordinator. Its heartbeat socket shares this
    object, so both draw counters from one sequence."""
    return FrameAuthenticator(key, rank, accept=[COORDINATOR])


def sender_name(sender: int) -> str:
    return "coordinator" if sender == COORDINATOR else f"rank {sender}"


class _ReplayWindow:
    """Counters seen from one sender: the highest, and a bitmap of the ``REPLAY_WINDOW`` below it."""

    def __init__(self) -> None:
        self.top = 0
        self.seen = 0  # bit i set: counter (top - i) was accepted

    def check(self, counter: int) -> str | None:
        if counter > self.top:
            return None
        age = self.top - counter
        if age >= REPLAY_WINDOW:
            return f"counter {counter} is older than the replay window (newest {self.top})"
        if self.seen >> age & 1:
            return f"counter {counter} was already accepted (replayed frame)"
        return None

    def accept(self, counter: int) -> None:
        if counter > self.top:
            shift = counter - self.top
            self.seen = ((self.seen << shift) | 1) & _WINDOW_MASK
            self.top = counter
        else:
            self.seen |= 1 << (self.top - counter)


class FrameAuthenticator(Framer):
    """One endpoint's signer and verifier, and the transport's framer for its sockets.

    ``sender`` is this endpoint's identity (a rank or COORDINATOR); ``accept`` the senders whose
    frames it takes (None: any sender except itself).
    """

    def __init__(self, key: bytes, sender: int, accept: Iterable[int] | None = None) -> None:
        if len(key) < 16:
            raise ValueError(f"the authentication key has {len(key)} bytes; at least 16 are required")
        if not 0 <= sender <= COORDINATOR:
            raise ValueError(f"sender {sender} is not a rank or the coordinator")
        self._key = bytes(key)
        self.sender = sender
        self._accept = None if accept is None else frozenset(accept)
        self._counter = itertools.count(1)
        self._windows: dict[tuple[bytes, int], _ReplayWindow] = {}
        self._lock = threading.Lock()
        self.drops: collections.Counter[str] = collections.Counter()

    def sign(self, payload: bytes) -> bytes:
        header = _HEADER.pack(AUTH_VERSION, self.sender, next(self._counter))
        body = header + payload
        return body + hmac.digest(self._key, body, "sha256")

    def verify(self, frame: bytes, peer: bytes = b"") -> bytes:
        """Return the payload of an authentic, fresh frame; otherwise count and raise.

        Freshness is kept per connection (``peer``, the sender's ZeroMQ identity at a ROUTER): a
        frame replayed on a connection of its own cannot use up the counters of the genuine one."""
        if len(frame) < OVERHEAD:
            self._drop("short", f"frame of {len(frame)} bytes is shorter than the {OVERHEAD}-byte minimum")
        frame = bytes(frame)
        version, sender, counter = _HEADER.unpack_from(frame)
        body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(hmac.digest(self._key, body, "sha256"), tag):
            self._drop("bad_tag", f"frame claiming {sender_name(sender)} has a wrong HMAC tag")
        if version != AUTH_VERSION:
            self._drop("version", f"authenticated frame version {version}, expected {AUTH_VERSION}")
        if sender == self.sender or (self._accept is not None and sender not in self._accept):
            self._drop(
                "sender", f"{sender_name(self.sender)} does not accept frames from {sender_name(sender)}"
            )
        with self._lock:
            window = self._windows.setdefault((peer, sender), _ReplayWindow())
            problem = window.check(counter)
            if problem is None:
                window.accept(counter)
        if problem is not None:
            self._drop("replay", f"{sender_name(sender)}: {problem}")
        return body[_HEADER.size :]

    # The transport's Framer interface: one payload <-> the frames that travel.
    def seal(self, payload: bytes) -> list[bytes]:
        return [self.sign(payload)]

    def open(self, frames: list[bytes], peer: bytes = b"") -> bytes:
        if len(frames) != 1:
            self._drop("framing", f"expected 1 frame, got {len(frames)}")
        return self.verify(frames[0], peer)

    def _drop(self, reason: str, detail: str) -> None:
        """Count the frame and raise; the receiver logs it (``protocol.rejections``)."""
        with self._lock:
            self.drops[reason] += 1
        raise ProtocolError(ProtocolError.UNAUTHENTICATED, detail, cause=reason)
