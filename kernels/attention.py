"""Paged causal attention references (GQA, fp32 math) over the paged KV cache."""

from __future__ import annotations

import torch


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [pages_total, page_size, Hkv, D], pages [..., P] -> [..., P * page_size, Hkv, D]."""
    gathered = cache[pages.long()]
    return gathered.reshape(*pages.shape[:-1], -1, *cache.shape[2:])


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D]; row b attends to positions [0, seq_lens[b]). Fixed shapes, no host sync.

    With ``gate`` [B, H, D] the output is ``attn * sigmoid(gate)`` in q's dtype (the attention
    output gate of Qwen3.5's full-attention layers, fused so decode needs no extra kernels)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys = _gather_pages(k_cache, page_table).float()  # [B, L, Hkv, D]
    values = _gather_pages(v_cache, page_table).float()
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale
    positions = torch.arange(keys.shape[1], device=q.device)
    visible = positions[None, :] < seq_lens.to(q.device).long()[:, None]  # [B, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(-1), values)
    out = out.reshape(batch, num_heads, head_dim).to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]; chunk i's token j (position starts[i]+j) attends to cached positions [0, pos]."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for i, start in enumerate(starts.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        context = start + hi - lo
        keys = _gather_pages(k_cache, page_tables[i])[:context].float()  # [L, Hkv, D]
        values = _gather_pages(v_cache, page_tables[i])[:context].float()
        qg = q[lo:hi].float().view(hi - lo, num_kv_heads, group, head_dim)
        scores = torch.einsum("tkgd,lkd->kgtl", qg, keys) * scale
        query_pos = torch.arange(start, context, device=q.device)
        key_pos = torch.arange(context, device=q.device)
        causal = key_pos[None, :] <= query_pos[:, None]  # [t, L]
        scores = scores.masked_fill(~causal, float("-inf"))
        chunk_out = torch.einsum("kgtl,lkd->tkgd", scores.softmax(-1), values)
        out[lo:hi] = chunk_out.reshape(hi - lo, num_heads, head_dim).to(q.dtype)
    return out
