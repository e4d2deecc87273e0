"""Paged KV cache write reference."""

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
