"""Paged KV cache references: the write, and where a decode step's new tokens go."""

from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into caches [pages, page_size, Hkv, D] at slot = page * page_size + offset."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_ids, k.to(k_cache.dtype))
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_ids, v.to(v_cache.dtype))


def decode_kv_indices_ref(
    positions: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KV slot ids int64 [B], sequence lengths int32 [B]) of a decode step: each row's new token
    at ``positions`` [B] int64 goes to slot page * page_size + offset of its page in
    ``page_table`` [B, P] int32, and the row then attends over positions + 1 tokens."""
    pages = page_table.gather(1, (positions // page_size).unsqueeze(1)).squeeze(1).long()
    return pages * page_size + positions % page_size, (positions + 1).to(torch.int32)
