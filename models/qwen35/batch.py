"""The model's step inputs: a prefill batch of variable-length chunks and a decode batch of rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from phalanx.kernels.upload import to_device
from phalanx.kernels.varlen import Varlen


def _host_page_table(page_lists: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[rows, width] int32; short rows are padded with their own first page (any valid id will do)."""
    table = np.zeros((len(page_lists), max(width, 1)), dtype=np.int32)
    for row, pages in enumerate(page_lists):
        if len(pages) > width:
            raise ValueError(f"page table row {row} has {len(pages)} pages, more than max_pages={width}")
        if pages:
            table[row, : len(pages)] = pages
            table[row, len(pages) :] = pages[0]
    return table


@dataclass
class PrefillBatch:
    """n chunks, T tokens in all; a chunk with start == 0 starts from zero recurrent/conv state."""

    tokens: torch.Tensor  # [T] int64, the chunks concatenated
    state_slots: torch.Tensor  # [n] int64
    page_tables: torch.Tensor  # [n, P] int32, covering positions [0, start+len)
    varlen: Varlen  # the chunk bounds in every form a layer's kernels read, worked out on the host
    token_range: tuple[int, int]  # (lowest, highest) token id, known on the host

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[n+1] int32: chunk i holds tokens [cu[i], cu[i+1])."""
        return self.varlen.cu_seqlens

    @property
    def starts(self) -> torch.Tensor:
        """[n] int32: the position of each chunk's first token."""
        return self.varlen.starts

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple[Sequence[int], int, int, Sequence[int]]],
        device: torch.device | str = "cpu",
        captures: Sequence[tuple[int, int, int]] = (),
    ) -> PrefillBatch:
        """chunks: (token ids, start position, state slot, page ids) per chunk; captures: (chunk,
        offset, state slot) per linear-attention state to leave behind mid-chunk (``StateCaptures``)."""
        if not chunks:
            raise ValueError("a prefill batch needs at least one chunk")
        device = torch.device(device)
        lengths = [len(tokens) for tokens, _, _, _ in chunks]
        if min(lengths) == 0:
            raise ValueError(f"prefill chunk {lengths.index(0)} has no tokens")
        starts = [start for _, start, _, _ in chunks]
        token_ids = np.fromiter((t for tokens, _, _, _ in chunks for t in tokens), dtype=np.int64)
        token_range = (int(token_ids.min()), int(token_ids.max()))
        varlen = Varlen.build(lengths, starts, device, captures)
        width = max(len(pages) for _, _, _, pages in chunks)
        return cls(
            tokens=to_device(torch.from_numpy(token_ids), device),
            state_slots=to_device(
                torch.tensor([slot for _, _, slot, _ in chunks], dtype=torch.int64), device
            ),
            page_tables=to_device(
                torch.from_numpy(_host_page_table([pages for *_, pages in chunks], width)), device
            ),
            varlen=varlen,
            token_range=token_range,
        )


@dataclass
class DecodeBatch:
    """B rows, one new token each."""

    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, the new token's position
    state_slots: torch.Tensor  # [B] int64
    page_table: torch.Tensor  # [B, P] int32
    # A host batch from ``build``: the numpy arrays its tensors view, [3, B] int64 (tokens,
    # positions, state slots) and the page table, which the graph runner stages from. Its staging
    # is on every graph step's critical path, and right after the GPU wait each numpy or torch
    # call there costs microseconds (docs/benchmarks/kernel-choices-h200.md).
    _host: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        rows: Sequence[tuple[int, int, int, Sequence[int]]],
        device: torch.device | str = "cpu",
        max_pages: int | None = None,
    ) -> DecodeBatch:
        """rows: (token, position, state slot, page ids) per row; page tables padded to max_pages."""
        if not rows:
            raise ValueError("a decode batch needs at least one row")
        device = torch.device(device)
        width = max_pages if max_pages is not None else max(len(pages) for *_, pages in rows)
        host_rows = np.array([[row[i] for row in rows] for i in range(3)], dtype=np.int64)
        table = _host_page_table([row[3] for row in rows], width)
        tokens, positions, slots = (to_device(torch.from_numpy(r), device) for r in host_rows)
        return cls(
            tokens=tokens,
            positions=positions,
            state_slots=slots,
            page_table=to_device(torch.from_numpy(table), device),
            # Only while the tensors view them: a device batch's tensors are copies.
            _host=(host_rows, table) if device.type == "cpu" else None,
        )

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """([3, B] int64 tokens, positions and state slots; [B, P] int32 page table) of a host batch."""
        if self._host is not None:
            return self._host
        rows = np.stack([t.numpy() for t in (self.tokens, self.positions, self.state_slots)])
        return rows, self.page_table.numpy()
