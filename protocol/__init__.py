"""The wire contract between the coordinator and its ranks. No torch here."""

from phalanx.protocol.codec import decode_envelope, decode_reply, encode, pack_ids, unpack_ids, unpack_list
from phalanx.protocol.errors import ProtocolError
from phalanx.protocol.messages import *  # noqa: F403
from phalanx.protocol.messages import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "ProtocolError",
    "decode_envelope",
    "decode_reply",
    "encode",
    "pack_ids",
    "unpack_ids",
    "unpack_list",
]
