"""The startup gate: how a rank proves who it is and joins a launch (see ``protocol.messages``).

The handshake binds a rank to the connection it speaks on: the coordinator answers each signed
Hello with a fresh nonce for that connection only, and takes the first Ready that is signed by the
rank, carries this launch's epoch and echoes the nonce sent on the same connection; from then on
that rank's commands go to that connection alone. A second claim of a bound rank, a Ready whose
nonce does not match (a replayed hello) and a peer that never sent a signed Hello get nothing.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from phalanx.protocol.values import Capacity


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="op"):
    """A rank's first frame on its connection: it claims its rank (the envelope's, signed)."""


class Challenge(msgspec.Struct, frozen=True, tag="challenge", tag_field="op"):
    """The answer to a Hello, on that connection only: its Ready must echo ``nonce``."""

    nonce: bytes


class Ready(msgspec.Struct, frozen=True, tag="ready", tag_field="op"):
    """A rank bound its device, loaded its shard and sized its capacity. ``nonce`` is its
    connection's Challenge, so a Ready recorded in another launch or on another connection is
    refused."""

    capacity: Capacity
    device: str
    pid: int
    host: str
    nonce: bytes = b""


class Go(msgspec.Struct, frozen=True, tag="go", tag_field="op"):
    """Start distributed init with this effective capacity (the minimum over ranks).

    ``collective_timeout`` (seconds; 0: the rank's own startup timeout) bounds every collective of
    the process group. The coordinator sets it below its step timeout, so that a rank left waiting
    for a hung peer fails (and the coordinator names the peer) before the step's deadline."""

    capacity: Capacity
    dist_init_method: str
    dist_backend: str
    collective_timeout: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0


class Cancel(msgspec.Struct, frozen=True, tag="cancel", tag_field="op"):
    """Startup failed somewhere: exit without entering distributed init."""

    reason: str


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", tag_field="op"):
    """Sent periodically by ranks the coordinator did not spawn, so it can notice them die."""

    unix_time: float
