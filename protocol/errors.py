"""Typed errors for frames that must never be executed."""

from __future__ import annotations


class ProtocolError(Exception):
    """A frame was rejected. ``reason`` is one of the class-level constants."""

    UNDECODABLE = "undecodable"
    UNKNOWN_TAG = "unknown_tag"
    WRONG_VERSION = "wrong_version"
    FOREIGN_EPOCH = "foreign_epoch"
    UNAUTHENTICATED = "unauthenticated"
    OUT_OF_RANGE = "out_of_range"
    UNBOUND_PEER = "unbound_peer"

    def __init__(self, reason: str, detail: str, cause: str = "") -> None:
        super().__init__(f"protocol error ({reason}): {detail}")
        self.reason = reason
        self.detail = detail
        self.cause = cause  # the finer reason an authenticator dropped the frame ("bad_tag", ...)
        self.peer: bytes | None = None  # the sender's ZeroMQ identity, where the socket knows it
