"""Triton paged causal prefill attention over variable-length chunks.

Same signature and semantics as ``kernels/attention.py`` ``paged_prefill_attention_ref``. Each
chunk's queries attend to the positions before them in its sequence's KV pages (the cached prefix
and the chunk itself, already written), one program per block of queries, chunk and head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.attention_triton import _DOT_F32, _check_cache, _load_kv_block
from phalanx.kernels.launch import FastLaunch, cdiv
from phalanx.kernels.varlen import Varlen


@triton.jit
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    pt_ptr,
    cu_ptr,
    starts_ptr,
    o_ptr,
    stride_qt,
    stride_qh,
    stride_page,
    stride_tok,
    stride_kvh,
    stride_ptb,
    stride_ot,
    stride_oh,
    scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    mb = tl.program_id(0)
    i = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    bos = tl.load(cu_ptr + i)
    length = tl.load(cu_ptr + i + 1) - bos
    if mb * BLOCK_M >= length:
        return
    start = tl.load(starts_ptr + i)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < length
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + (bos + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = start + rows
    kv_end = start + tl.minimum(length, (mb + 1) * BLOCK_M)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    pt_row = pt_ptr + i * stride_ptb
    kc = kc_ptr + kvh * stride_kvh
    vc = vc_ptr + kvh * stride_kvh
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_end
        k = _load_kv_block(kc, pt_row, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
        v = _load_kv_block(vc, pt_row, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(pos_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    o_ptrs = o_ptr + (bos + rows)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])


# Launched once per attention layer of every prefill: the cheaper launch path (kernels/launch.py).
_prefill_launch = FastLaunch(_prefill_kernel)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    varlen: Varlen | None = None,
) -> torch.Tensor:
    tokens, heads, dim = q.shape
    _check_cache(k_cache, v_cache, dim)
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    n_chunks = cu_seqlens.shape[0] - 1
    if tokens == 0 or n_chunks == 0:
        return out
    # Without varlen the longest chunk is read on the host: prefill is never graph-captured.
    longest = varlen.longest if varlen is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_m, block_n = 64, 32
    device = q.device
    page_tables = page_tables.to(device)
    _prefill_launch(
        (cdiv(longest, block_m), n_chunks, heads),
        q,
        k_cache,
        v_cache,
        page_tables,
        cu_seqlens.to(device=device, dtype=torch.int32),
        starts.to(device=device, dtype=torch.int32),
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        heads // kv_heads,
        dim,
        page_size,
        block_m,
        block_n,
        _DOT_F32,
        num_warps=8,
        num_stages=2,
    )
    return out
