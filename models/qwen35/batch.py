"""The model's step inputs: a prefill batch of variable-length chunks and a decode batch of rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _page_table(page_lists: Sequence[Sequence[int]], width: int, device: torch.device) -> torch.Tensor:
    """[rows, width] int32; short rows are padded with their own first page (any valid id will do)."""
    table = torch.zeros(len(page_lists), max(width, 1), dtype=torch.int32)
    for row, pages in enumerate(page_lists):
        if len(pages) > width:
            raise ValueError(f"page table row {row} has {len(pages)} pages, more than max_pages={width}")
        if pages:
            table[row, : len(pages)] = torch.tensor(list(pages), dtype=torch.int32)
            table[row, len(pages) :] = pages[0]
    return table.to(device)


@dataclass
class PrefillBatch:
    """n chunks, T tokens in all; a chunk with start == 0 starts from zero recurrent/conv state."""

    tokens: torch.Tensor  # [T] int64, the chunks concatenated
    cu_seqlens: torch.Tensor  # [n+1] int32
    starts: torch.Tensor  # [n] int32, position of each chunk's first token
    state_slots: torch.Tensor  # [n] int64
    page_tables: torch.Tensor  # [n, P] int32, covering positions [0, start+len)

    @property
    def num_chunks(self) -> int:
        return self.starts.shape[0]

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple[Sequence[int], int, int, Sequence[int]]],
        device: torch.device | str = "cpu",
    ) -> PrefillBatch:
        """chunks: (token ids, start position, state slot, page ids) per chunk."""
        if not chunks:
            raise ValueError("a prefill batch needs at least one chunk")
        device = torch.device(device)
        lengths = [len(tokens) for tokens, _, _, _ in chunks]
        if min(lengths) == 0:
            raise ValueError(f"prefill chunk {lengths.index(0)} has no tokens")
        cu_seqlens = torch.zeros(len(chunks) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        width = max(len(pages) for _, _, _, pages in chunks)
        return cls(
            tokens=torch.tensor([t for tokens, _, _, _ in chunks for t in tokens], dtype=torch.int64).to(
                device
            ),
            cu_seqlens=cu_seqlens.to(device),
            starts=torch.tensor([start for _, start, _, _ in chunks], dtype=torch.int32).to(device),
            state_slots=torch.tensor([slot for _, _, slot, _ in chunks], dtype=torch.int64).to(device),
            page_tables=_page_table([pages for _, _, _, pages in chunks], width, device),
        )


@dataclass
class DecodeBatch:
    """B rows, one new token each."""

    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, the new token's position
    state_slots: torch.Tensor  # [B] int64
    page_table: torch.Tensor  # [B, P] int32

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
        return cls(
            tokens=torch.tensor([row[0] for row in rows], dtype=torch.int64).to(device),
            positions=torch.tensor([row[1] for row in rows], dtype=torch.int64).to(device),
            state_slots=torch.tensor([row[2] for row in rows], dtype=torch.int64).to(device),
            page_table=_page_table([row[3] for row in rows], width, device),
        )
