"""Triton paged causal prefill attention over variable-length chunks.

Same signature and semantics as ``kernels/attention.py`` ``paged_prefill_attention_ref``. Each
chunk's queries attend to the positions before them in its sequence's KV pages (the cached prefix
and the chunk itself, already written), one program per block of queries, chunk, head and split of
the keys. A few query blocks over a long prefix (a prefix-cache hit's new tokens) would leave most
of the GPU idle with one program per block: their keys are cut into splits, each split's fp32
output and log-sum-exp merged after, as in flash-decoding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.attention_triton import _DOT_F32, _SMS, _check_cache, _load_kv_block, _split_size
from phalanx.kernels.launch import FastLaunch, cdiv
from phalanx.kernels.varlen import Varlen


@triton.jit
def _attend_keys(
    q, kc, vc, pt_row, pos, bound, q_pos, stride_page, stride_tok, d, qk_scale, m, l_sum, acc,
    PAGE: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Keys ``pos`` (those below ``bound``) into the online softmax, in log2 units; ``CAUSAL`` also
    hides each key from the queries before it."""
    pos_mask = pos < bound
    k = _load_kv_block(kc, pt_row, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
    v = _load_kv_block(vc, pt_row, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if CAUSAL:
        s = tl.where(pos_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    else:
        s = tl.where(pos_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A split past a row's own position holds no key for it: its max stays -inf, and exp2
    # against 0 keeps its sum and output at 0 where exp2(-inf - -inf) would be NaN.
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_sum, acc


# ``splits`` and the page table's row stride (an eager batch's widest table) are runtime values, not
# specialised: one binary per ``SPLIT`` serves every batch, where a binary per split count and
# stride class compiled in the middle of serving, stalling every stream (serve-h200.md, 2026-12-04).
@triton.jit(do_not_specialize=["stride_ptb", "splits"])
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    pt_ptr,
    cu_ptr,
    starts_ptr,
    o_ptr,
    po_ptr,
    plse_ptr,
    H,
    stride_qt,
    stride_qh,
    stride_page,
    stride_tok,
    stride_kvh,
    stride_ptb,
    stride_ot,
    stride_oh,
    scale,
    splits,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    mb = tl.program_id(0) // splits
    sp = tl.program_id(0) % splits
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
    split_size = _split_size(kv_end, splits, BLOCK_N)
    kv_lo = sp * split_size
    kv_hi = tl.minimum(kv_lo + split_size, kv_end)
    # Keys before the block's first query are seen by every row: that loop needs no causal mask.
    seen_by_all = tl.maximum(tl.minimum(kv_hi, start + mb * BLOCK_M), kv_lo)
    qk_scale = scale * 1.4426950408889634  # scores in log2 units: exp2 is the cheaper instruction
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    pt_row = pt_ptr + i * stride_ptb
    kc = kc_ptr + kvh * stride_kvh
    vc = vc_ptr + kvh * stride_kvh
    for n0 in range(kv_lo, seen_by_all, BLOCK_N):
        m, l_sum, acc = _attend_keys(
            q, kc, vc, pt_row, n0 + tl.arange(0, BLOCK_N), seen_by_all, q_pos, stride_page, stride_tok,
            d, qk_scale, m, l_sum, acc, PAGE=PAGE, CAUSAL=False, DOT_F32=DOT_F32,
        )  # fmt: skip
    for n0 in range(seen_by_all, kv_hi, BLOCK_N):
        m, l_sum, acc = _attend_keys(
            q, kc, vc, pt_row, n0 + tl.arange(0, BLOCK_N), kv_hi, q_pos, stride_page, stride_tok,
            d, qk_scale, m, l_sum, acc, PAGE=PAGE, CAUSAL=True, DOT_F32=DOT_F32,
        )  # fmt: skip
    safe_l = tl.where(l_sum > 0.0, l_sum, 1.0)
    out = acc / safe_l[:, None]
    tokens = bos + rows
    if not SPLIT:
        o_ptrs = o_ptr + tokens[:, None] * stride_ot + h * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        lse = tl.where(l_sum > 0.0, (m + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))  # natural log
        part = (tokens * H + h) * splits + sp
        tl.store(po_ptr + part[:, None] * D + d[None, :], out, mask=row_mask[:, None])
        tl.store(plse_ptr + part, lse, mask=row_mask)


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(
    po_ptr, plse_ptr, o_ptr, H, stride_ot, stride_oh, splits, D: tl.constexpr, SPLIT_TILE: tl.constexpr,
):  # fmt: skip
    """One token and head: its splits' outputs weighted by their share of the softmax sum."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    base = (t * H + h) * splits
    s = tl.arange(0, SPLIT_TILE)  # splits past the count masked off
    lse = tl.load(plse_ptr + base + s, mask=s < splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    held = lse > float("-inf")
    w = tl.where(held, tl.exp(lse - m), 0.0)
    parts = tl.load(po_ptr + (base + s)[:, None] * D + d[None, :], mask=held[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


# Launched once per attention layer of every prefill: the cheaper launch path (kernels/launch.py).
_prefill_launch = FastLaunch(_prefill_kernel)
_merge_launch = FastLaunch(_merge_kernel)

# More splits than it takes to fill the GPU once only add partials to merge: a prefix hit's 128 new
# tokens over 4,224 keys, 43.7 us a layer at 16 splits, 34.2 at 8 (docs/benchmarks/kernel-choices-h200.md)
_MAX_SPLITS = 16
# A program's tile: 128 queries by 64 keys on 8 warps, 2.6x the throughput of 64 by 32 at 4,096
# tokens on the H200; a split launch takes one more pipeline stage (kernel-choices-h200.md).
_BLOCK_M = 128
_BLOCK_N = 64
_WARPS = 8


def prefill_splits(tokens: int, heads: int) -> int:
    """Key splits per query block: enough programs to fill the GPU once, a power of two up to 16.
    The batch's query blocks are counted as if its ``tokens`` made one chunk (padding chunks and
    short chunks hold little work). Taken from launch sizes only (never from a prefix's
    length, which lives on the device), so a prefill graph's bucket and the same padded batch run
    eagerly cut the keys alike."""
    programs = max(cdiv(tokens, _BLOCK_M) * heads, 1)
    want = max(_SMS // programs, 1)
    return min(1 << (want.bit_length() - 1), _MAX_SPLITS)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    varlen: Varlen | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """``splits`` (a power of two) overrides the key splits ``prefill_splits`` would choose."""
    tokens, heads, dim = q.shape
    _check_cache(k_cache, v_cache, dim)
    if splits is not None and (splits < 1 or splits & (splits - 1) or splits > _MAX_SPLITS):
        raise ValueError(f"prefill attention splits must be a power of two up to {_MAX_SPLITS}, got {splits}")
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    n_chunks = cu_seqlens.shape[0] - 1
    if tokens == 0 or n_chunks == 0:
        return out
    # Without varlen the longest chunk is read on the host (an eager pass; a graph passes varlen).
    longest = varlen.longest if varlen is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    query_blocks = cdiv(longest, _BLOCK_M)
    if splits is None:
        splits = prefill_splits(tokens, heads)
    part_o, part_lse = out, out  # unused pointers without splits
    if splits > 1:
        # Padding rows past the last chunk are never written: -inf makes the merge give them 0.
        part_lse = torch.full((tokens, heads, splits), float("-inf"), dtype=torch.float32, device=q.device)
        part_o = torch.empty((tokens, heads, splits, dim), dtype=torch.float32, device=q.device)
    device = q.device
    page_tables = page_tables.to(device)
    _prefill_launch(
        (query_blocks * splits, n_chunks, heads),
        q,
        k_cache,
        v_cache,
        page_tables,
        cu_seqlens.to(device=device, dtype=torch.int32),
        starts.to(device=device, dtype=torch.int32),
        out,
        part_o,
        part_lse,
        heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        splits,
        heads // kv_heads,
        dim,
        page_size,
        _BLOCK_M,
        _BLOCK_N,
        splits > 1,
        _DOT_F32,
        num_warps=_WARPS,
        num_stages=2 if splits == 1 else 3,
    )
    if splits > 1:
        _merge_launch(
            (tokens, heads),
            part_o,
            part_lse,
            out,
            heads,
            out.stride(0),
            out.stride(1),
            splits,
            dim,
            _MAX_SPLITS,
            num_warps=4,
        )
    return out
