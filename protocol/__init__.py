"""The wire contract between the coordinator and its ranks. No torch here."""

from protocol.codec import decode_envelope, decode_reply, encode
from protocol.errors import ProtocolError
from protocol.messages import *  # noqa: F403
from protocol.messages import PROTOCOL_VERSION
from protocol.packing import pack_ids, unpack_ids, unpack_list

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
