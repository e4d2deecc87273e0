"""The one codec: msgpack via msgspec, typed decoding, version and epoch checks; and the compact
form of id lists inside messages (little-endian int32 bytes, not one msgpack object per id).

``encode`` checks what it encodes against the wire limits of ``protocol.messages`` (by decoding
it again), so a value that does not fit raises here, before it is sent, rather than at a rank."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from phalanx.protocol.errors import ProtocolError
from phalanx.protocol.messages import PROTOCOL_VERSION, Envelope, ReplyEnvelope

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_reply_decoder = msgspec.msgpack.Decoder(ReplyEnvelope)


def encode(message: Envelope | ReplyEnvelope) -> bytes:
    what = "command" if isinstance(message, Envelope) else "reply"
    try:
        frame = _encoder.encode(message)
    except OverflowError as exc:  # an integer beyond msgpack's 64 bits
        raise ProtocolError(ProtocolError.OUT_OF_RANGE, f"{what} cannot be encoded: {exc}") from None
    try:
        (_envelope_decoder if what == "command" else _reply_decoder).decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ProtocolError.OUT_OF_RANGE, f"{what} does not fit the wire: {exc}") from None
    return frame


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes, epoch: int | None, what: str):
    try:
        message = decoder.decode(frame)
    except msgspec.ValidationError as exc:
        text = str(exc)
        reason = ProtocolError.UNKNOWN_TAG if "Invalid value" in text and "op`" in text else None
        if reason is None and "Invalid value" in text and "phase`" in text:
            reason = ProtocolError.UNKNOWN_TAG
        if reason is None and any(bound in text for bound in ("<=", ">=", " < ", " > ")):
            reason = ProtocolError.OUT_OF_RANGE
        raise ProtocolError(reason or ProtocolError.UNDECODABLE, f"{what}: {text}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ProtocolError.UNDECODABLE, f"{what}: {exc}") from None
    if message.proto != PROTOCOL_VERSION:
        raise ProtocolError(
            ProtocolError.WRONG_VERSION,
            f"{what} has protocol version {message.proto}, expected {PROTOCOL_VERSION}",
        )
    if epoch is not None and message.epoch != epoch:
        raise ProtocolError(
            ProtocolError.FOREIGN_EPOCH, f"{what} has epoch {message.epoch}, expected {epoch}"
        )
    return message


class _Header(msgspec.Struct):
    proto: int
    epoch: int
    seq: int
    body: msgspec.Raw


_header_decoder = msgspec.msgpack.Decoder(_Header)


def envelope_header(frame: bytes) -> tuple[int, int, int] | None:
    """(proto, epoch, seq) of a command frame whose body may not decode; None if even those do not."""
    try:
        header = _header_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return header.proto, header.epoch, header.seq


def decode_envelope(frame: bytes, epoch: int | None = None) -> Envelope:
    """Decode a coordinator frame; ``epoch`` None accepts any epoch (a rank learning it)."""
    return _decode(_envelope_decoder, frame, epoch, "command frame")


def decode_reply(frame: bytes, epoch: int | None = None) -> ReplyEnvelope:
    return _decode(_reply_decoder, frame, epoch, "reply frame")


_INT32 = np.dtype("<i4")


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """Pack token ids or page ids as little-endian int32 bytes."""
    return np.asarray(ids, dtype=_INT32).tobytes()


def unpack_ids(packed: bytes) -> np.ndarray:
    """Inverse of :func:`pack_ids`; returns a read-only int32 array view."""
    if len(packed) % 4:
        raise ValueError(f"packed id buffer of {len(packed)} bytes is not a multiple of 4")
    return np.frombuffer(packed, dtype=_INT32)


def unpack_list(packed: bytes) -> list[int]:
    return unpack_ids(packed).tolist()
