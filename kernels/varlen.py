"""How a prefill batch's tokens split into chunks, worked out once on the host for every layer.

Each varlen kernel wants the chunk bounds in its own form: int32 bounds and starts, the chunk of
every token, fla-core's (sequence, chunk) pairs, and the longest chunk as a launch size. Derived
from device tensors inside each layer, the longest chunk and fla-core's chunk count each cost the
host a sync, 32 layers over: a 512-token prefill of the 4B model spent most of its time waiting
on them (docs/benchmarks/prefill-h200.md). From the host lists they cost nothing on the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from phalanx.kernels.upload import to_device

GDN_CHUNK = 64
"""Tokens per chunk of fla-core's chunked delta rule (its default, and the only size we run)."""


@dataclass(frozen=True)
class StateCaptures:
    """Linear-attention states a prefill also leaves behind mid-chunk (prefix-cache snapshots).

    Capture i: the state of chunk ``chunks[i]`` after its first ``offsets[i]`` tokens goes into
    state slot ``slots[i]``, in the same pass. The chunked delta rule holds the state at the start
    of each of its 64-token chunks anyway, so an offset must be a multiple of ``GDN_CHUNK``.
    """

    chunks: tuple[int, ...]  # host
    offsets: tuple[int, ...]  # host
    token_ends: torch.Tensor  # [m] int64: batch index of the first token after the captured point
    gdn_chunks: torch.Tensor  # [m] int64: the fla-core chunk that starts at the captured point
    slots: torch.Tensor  # [m] int64: destination state slots


@dataclass(frozen=True)
class Varlen:
    """n chunks of T tokens in all, as every prefill kernel reads them (tensors on the device)."""

    cu_seqlens: torch.Tensor  # [n+1] int32: chunk i holds tokens [cu[i], cu[i+1])
    cu_seqlens_long: torch.Tensor  # [n+1] int64, fla-core's dtype
    starts: torch.Tensor  # [n] int32: position of each chunk's first token
    has_initial_state: torch.Tensor  # [n] bool: the chunk continues a cached prefix
    chunk_of_token: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int64
    gdn_chunks: torch.Tensor  # [NT, 2] int64: fla-core's chunk_indices for GDN_CHUNK
    longest: int  # tokens of the longest chunk
    ends: tuple[int, ...]  # each chunk's start + length, on the host
    continues: bool  # some chunk continues a cached prefix (has an initial state), on the host
    continues_all: bool  # every chunk does, on the host
    captures: StateCaptures | None = None

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        starts: Sequence[int],
        device: torch.device,
        captures: Sequence[tuple[int, int, int]] = (),
    ) -> Varlen:
        """``captures``: (chunk, offset, state slot) per state to leave behind (``StateCaptures``)."""
        layout = VarlenLayout.plan(lengths, starts, captures)
        # One upload for everything, then views and dtype casts on the device.
        return cls.from_packed(to_device(torch.from_numpy(layout.packed), device), layout)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, layout: VarlenLayout) -> Varlen:
        """The device forms of ``layout`` from its packed values on the device (``packed`` may be
        a longer buffer: a captured prefill reads its inputs from a fixed one)."""
        n, tokens, nt, m = layout.counts
        sizes = [n + 1, n, tokens, tokens, nt, nt, m, m, m]
        cu_long, starts_dev, chunk_dev, positions_dev, sequence_dev, index_dev, *captured = packed[
            : sum(sizes)
        ].split(sizes)
        return cls(
            cu_seqlens=cu_long.to(torch.int32),
            cu_seqlens_long=cu_long,
            starts=starts_dev.to(torch.int32),
            has_initial_state=starts_dev > 0,
            chunk_of_token=chunk_dev.to(torch.int32),
            positions=positions_dev,
            gdn_chunks=torch.stack([sequence_dev, index_dev], 1),
            longest=layout.longest,
            ends=layout.ends,
            continues=layout.continues,
            continues_all=layout.continues_all,
            captures=StateCaptures(layout.capture_chunks, layout.capture_offsets, *captured) if m else None,
        )


@dataclass(frozen=True)
class VarlenLayout:
    """A varlen batch worked out on the host: its packed int64 values (bounds, starts, chunk of
    each token, positions, fla-core's chunk indices, the captures) and the host facts."""

    packed: np.ndarray
    counts: tuple[int, int, int, int]  # chunks, tokens, fla-core chunks, captures
    longest: int
    ends: tuple[int, ...]
    continues: bool
    continues_all: bool
    capture_chunks: tuple[int, ...]
    capture_offsets: tuple[int, ...]

    @classmethod
    def plan(
        cls, lengths: Sequence[int], starts: Sequence[int], captures: Sequence[tuple[int, int, int]] = ()
    ) -> VarlenLayout:
        if not lengths or min(lengths) < 1 or len(starts) != len(lengths):
            raise ValueError(f"a varlen batch needs chunks of at least one token, got {list(lengths)}")
        for chunk, offset, _ in captures:
            if not 0 <= chunk < len(lengths) or not 0 < offset < lengths[chunk] or offset % GDN_CHUNK:
                raise ValueError(
                    f"a state capture after {offset} tokens of chunk {chunk} must fall inside the chunk "
                    f"at a multiple of {GDN_CHUNK} tokens"
                )
        length = np.asarray(lengths, dtype=np.int64)
        start = np.asarray(starts, dtype=np.int64)
        cu = np.zeros(len(length) + 1, dtype=np.int64)
        np.cumsum(length, out=cu[1:])
        chunk_of_token = np.repeat(np.arange(len(length)), length)
        positions = start[chunk_of_token] + np.arange(cu[-1]) - cu[:-1][chunk_of_token]
        gdn_counts = -(-length // GDN_CHUNK)
        gdn_sequence = np.repeat(np.arange(len(length)), gdn_counts)
        gdn_offsets = np.zeros(len(length) + 1, dtype=np.int64)
        np.cumsum(gdn_counts, out=gdn_offsets[1:])
        gdn_index = np.arange(gdn_offsets[-1]) - gdn_offsets[:-1][gdn_sequence]
        capture = np.asarray(captures, dtype=np.int64).reshape(-1, 3)
        capture_chunk, capture_offset, capture_slot = capture.T
        token_ends = cu[capture_chunk] + capture_offset
        gdn_chunks = gdn_offsets[capture_chunk] + capture_offset // GDN_CHUNK
        parts = [
            cu,
            start,
            chunk_of_token,
            positions,
            gdn_sequence,
            gdn_index,
            token_ends,
            gdn_chunks,
            capture_slot,
        ]
        return cls(
            packed=np.concatenate(parts),
            counts=(len(length), int(cu[-1]), len(gdn_sequence), len(capture)),
            longest=int(length.max()),
            ends=tuple((start + length).tolist()),
            continues=bool(start.any()),
            continues_all=bool(start.all()),
            capture_chunks=tuple(capture_chunk.tolist()),
            capture_offsets=tuple(capture_offset.tolist()),
        )
