"""Compact encodings for id lists: little-endian int32 bytes, not one msgpack object per id."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
