"""Triton paged decode attention (flash-decoding with split-K) and the paged K/V reads it shares
with the prefill kernel (``kernels/attention_prefill_triton.py``).

Same signatures and semantics as ``kernels/attention.py``. KV cache ``[pages, page_size, Hkv, D]``;
a position p of a sequence lives at page ``page_table[p // page_size]``, offset ``p % page_size``.
Decode is CUDA-graph capturable: every launch parameter comes from tensor shapes, never values."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, prefetch_l2, wait_for_producer

# The CPU interpreter computes bf16 dot products wrongly; upcast the operands there.
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"
# Decode attention requests its split's first K/V block into L2 before the PDL wait (inline PTX,
# so never under the interpreter).
PREFETCH_KV = not _DOT_F32
_SMS = 132  # H200; only sizes the split-K grid, so a different GPU is still correct


@triton.jit
def _split_size(seq_len, splits, BLOCK_N: tl.constexpr):
    """Keys per split of a row: each row cuts its own keys, by its length and the split count
    only, never by the batch size or the page-table width, so eager and graph decode agree bit
    for bit (and the merge knows which splits hold keys)."""
    return tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N


@triton.jit
def _kv_offsets(pt_row_ptr, pos, pos_mask, stride_page, stride_tok, d, PAGE: tl.constexpr):
    """The [positions, D] element offsets of cached tokens ``pos`` within one KV head's cache.

    In 64 bits: a pool sized to the GPU holds more than 2^31 elements per layer, and the padding
    page sits at its end."""
    page = tl.load(pt_row_ptr + pos // PAGE, mask=pos_mask, other=0).to(tl.int64)
    return page[:, None] * stride_page + (pos % PAGE)[:, None] * stride_tok + d[None, :]


@triton.jit
def _load_kv_block(cache_ptr, pt_row_ptr, pos, pos_mask, stride_page, stride_tok, d, PAGE: tl.constexpr):
    offsets = _kv_offsets(pt_row_ptr, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
    return tl.load(cache_ptr + offsets, mask=pos_mask[:, None], other=0.0)


@triton.jit
def _attend_block(q, k, v, pos_mask, m, l_sum, acc, scale, DOT_F32: tl.constexpr):
    """One block of keys into the online softmax: the new running max, sum and output."""
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(pos_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_sum, acc


@triton.jit
def _apply_gate(out, gate, dtype: tl.constexpr):
    """attn * sigmoid(gate), rounded where the unfused bf16 chain rounds: attn, the sigmoid, the product."""
    attn = out.to(dtype).to(tl.float32)
    return attn * tl.sigmoid(gate.to(tl.float32)).to(dtype).to(tl.float32)


# ``splits`` is a runtime argument, not specialised: one binary serves every batch bucket (each
# bucket cuts the keys into a different number of splits), one compile instead of six.
@triton.jit(do_not_specialize=["splits"])
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    pt_ptr,
    lens_ptr,
    o_ptr,
    po_ptr,
    plse_ptr,
    gate_ptr,
    stride_qb,
    stride_qh,
    stride_page,
    stride_tok,
    stride_kvh,
    stride_ptb,
    stride_ob,
    stride_oh,
    stride_gb,
    stride_gh,
    H,
    scale,
    splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # 1. Before the wait: the row's length and where its split's first keys live. The lengths and
    # page tables come from kernels at least two launches back (the rule is in kernels/launch.py);
    # the cached K/V are read after it, as the kernel just before writes each row's newest token.
    # (Loading the first K/V block here instead holds registers across the wait, which costs
    # batch 64 more than batch 1 gains: docs/benchmarks/kernel-choices-h200.md.)
    seq_len = tl.load(lens_ptr + b)
    split_size = _split_size(seq_len, splits, BLOCK_N)
    start = sp * split_size
    end = tl.minimum(start + split_size, seq_len)
    d = tl.arange(0, D)
    pt_row = pt_ptr + b * stride_ptb
    kc = kc_ptr + kvh * stride_kvh
    vc = vc_ptr + kvh * stride_kvh
    pos = start + tl.arange(0, BLOCK_N)
    pos_mask = pos < end
    first = _kv_offsets(pt_row, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
    # That block's cache lines are requested into L2 (registers would be held across the wait):
    # the block is then an L2 hit after it, newest token included, as the kernel before writes it
    # into L2 (measured: docs/benchmarks/kernel-choices-h200.md).
    if PREFETCH_LINES > 0:
        line_starts = tl.arange(0, PREFETCH_LINES) * (D // PREFETCH_LINES)
        lines = _kv_offsets(pt_row, pos, pos_mask, stride_page, stride_tok, line_starts, PAGE=PAGE)
        prefetch_l2(kc + lines, pos_mask[:, None])
        prefetch_l2(vc + lines, pos_mask[:, None])
    wait_for_producer(USE_PDL)

    # 2. q and the first block, then the online softmax over it and the split's other blocks.
    k = tl.load(kc + first, mask=pos_mask[:, None], other=0.0)
    v = tl.load(vc + first, mask=pos_mask[:, None], other=0.0)
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    if start < end:
        m, l_sum, acc = _attend_block(q, k, v, pos_mask, m, l_sum, acc, scale, DOT_F32)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        k = _load_kv_block(kc, pt_row, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
        v = _load_kv_block(vc, pt_row, pos, pos_mask, stride_page, stride_tok, d, PAGE=PAGE)
        m, l_sum, acc = _attend_block(q, k, v, pos_mask, m, l_sum, acc, scale, DOT_F32)
    safe_l = tl.where(l_sum > 0.0, l_sum, 1.0)
    out = acc / safe_l[:, None]
    if not SPLIT:
        if HAS_GATE:
            g_ptrs = gate_ptr + b * stride_gb + heads[:, None] * stride_gh + d[None, :]
            out = _apply_gate(out, tl.load(g_ptrs, mask=g_mask[:, None], other=0.0), o_ptr.dtype.element_ty)
        o_ptrs = o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # Partial results for the merge: fp32 output and log-sum-exp (-inf for an empty split).
        lse = tl.where(l_sum > 0.0, m + tl.log(safe_l), float("-inf"))
        part = (b * H + heads) * splits + sp
        tl.store(po_ptr + part[:, None] * D + d[None, :], out, mask=g_mask[:, None])
        tl.store(plse_ptr + part, lse, mask=g_mask)


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(
    po_ptr,
    plse_ptr,
    lens_ptr,
    o_ptr,
    gate_ptr,
    H,
    stride_ob,
    stride_oh,
    stride_gb,
    stride_gh,
    splits,
    D: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    # Before the wait: the row's length (which splits hold keys: a short row leaves the last ones
    # empty, and their partials are never read) and the gate, from the linear three launches back.
    seq_len = tl.load(lens_ptr + b)
    split_size = _split_size(seq_len, splits, BLOCK_N)
    s = tl.arange(0, SPLIT_TILE)  # splits past the count masked off
    s_mask = s < tl.minimum(tl.cdiv(seq_len, tl.maximum(split_size, 1)), splits)
    if HAS_GATE:
        gate = tl.load(gate_ptr + b * stride_gb + h * stride_gh + d)
    wait_for_producer(USE_PDL)
    base = (b * H + h) * splits
    lse = tl.load(plse_ptr + base + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    parts = tl.load(po_ptr + (base + s)[:, None] * D + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    if HAS_GATE:
        out = _apply_gate(out, gate, o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


_decode_launch = FastLaunch(_decode_kernel, pdl=True)
_merge_launch = FastLaunch(_merge_kernel, pdl=True)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dim: int) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)}{k_cache.stride()} and v_cache {tuple(v_cache.shape)}"
            f"{v_cache.stride()} must share one layout with contiguous head_dim"
        )
    if k_cache.shape[-1] != dim or dim != next_pow2(dim):
        raise ValueError(
            f"head_dim must be a power of two matching the cache, got q {dim}, cache {k_cache.shape[-1]}"
        )


_MAX_SPLITS = 64
# Short splits: a bucket that cuts each row into this many splits or more (batch 1 to 4 at the 4B
# geometry) is latency-bound. Its attention takes the keys 16 at a time, not 32, so that at batch 1
# (64 splits of 512 keys) twice as many programs hold keys; its merge runs on 8 warps, not 4, so
# that at head_dim 256 each thread holds 64 of the [64 splits, D] partials, not 128 (measured:
# docs/benchmarks/kernel-choices-h200.md).
# Both follow the split count only, so eager and graph decode of one bucket cut the keys alike
# (the merge's launch shape for every count: ``_merge_launch_shape``).
_SHORT_SPLITS = 32


def _merge_launch_shape(splits: int) -> tuple[int, int]:
    """(the merge's split tile, its warps) for ``splits`` splits. The tile is the split count's
    power of two, not the 64 splits the merge can hold: one binary per count (six at the 4B
    buckets) where one served all, for a faster step at the batches whose rows are cut in few
    splits. Eight warps for short splits (above) and for a tile of two, four between, where eight
    were slower (measured: docs/benchmarks/kernel-choices-h200.md)."""
    tile = next_pow2(splits)
    return tile, 8 if splits >= _SHORT_SPLITS or splits <= 2 else 4


def _decode_splits(batch: int, kv_heads: int) -> int:
    """Enough programs to fill the GPU twice. Taken from the batch's bucket (its next power of two,
    as the graph buckets are), so a batch run eagerly and its bucket's graph split alike."""
    want = cdiv(2 * _SMS, next_pow2(batch) * max(kv_heads, 1))
    return next_pow2(min(max(want, 1), _MAX_SPLITS))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_cache(k_cache, v_cache, q.shape[-1])
    splits = _decode_splits(q.shape[0], k_cache.shape[2])
    return decode_attention_with_splits(q, k_cache, v_cache, page_table, seq_lens, scale, splits, gate)


def decode_attention_with_splits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode attention with the KV range cut into ``splits`` parts (1 to 64)."""
    if not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"decode attention splits must be 1 to {_MAX_SPLITS}, got {splits}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    part_o, part_lse = _decode_partials(q, splits, out)
    for launch, grid, args, options in _decode_launches(
        q, k_cache, v_cache, page_table, seq_lens, scale, splits, gate, out, part_o, part_lse
    ):
        launch(grid, *args, **options)
    return out


def _decode_partials(q: torch.Tensor, splits: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's output and log-sum-exp (fp32), merged after; ``out`` itself for one split."""
    if splits == 1:
        return out, out
    batch, heads, dim = q.shape
    part_o = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    return part_o, part_lse


def _decode_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int,
    gate: torch.Tensor | None,
    out: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
) -> list[tuple[FastLaunch, tuple[int, ...], tuple[object, ...], dict[str, int]]]:
    """(launch, grid, arguments, options) of the attention kernel and, with splits, the merge."""
    batch, heads, dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    gate_arg = q if gate is None else gate  # an unused pointer when there is no gate
    short_splits = splits >= _SHORT_SPLITS
    block_n = 16 if short_splits else 32  # keys per softmax block, and per split at least
    attention = (
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        out,
        part_o,
        part_lse,
        gate_arg,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        gate_arg.stride(0),
        gate_arg.stride(1),
        heads,
        scale,
        splits,
        group,
        max(16, next_pow2(group)),
        dim,
        page_size,
        block_n,
        splits > 1,
        _DOT_F32,
        gate is not None,
        # The 128-byte lines of one cached token's head vector (at least one: a short head).
        max(dim * k_cache.element_size() // 128, 1) if PREFETCH_KV else 0,
    )
    launches = [(_decode_launch, (batch, kv_heads, splits), attention, {"num_warps": 4, "num_stages": 2})]
    if splits > 1:
        merge_tile, merge_warps = _merge_launch_shape(splits)
        merge = (
            part_o,
            part_lse,
            seq_lens,
            out,
            gate_arg,
            heads,
            out.stride(0),
            out.stride(1),
            gate_arg.stride(0),
            gate_arg.stride(1),
            splits,
            dim,
            merge_tile,
            block_n,
            gate is not None,
        )
        launches.append((_merge_launch, (batch, heads), merge, {"num_warps": merge_warps}))
    return launches


BoundDecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def bind_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> BoundDecodeAttention | None:
    """``paged_decode_attention`` bound to one layer's caches and to the layout of these inputs:
    a function of (q, page_table, seq_lens, gate) -> out that allocates the output (and the
    splits' partials) and launches through ``FastLaunch.bind``. None where the general path
    would copy an input first, or for an empty batch."""
    batch = q.shape[0]
    if batch == 0 or q.stride(-1) != 1 or (gate is not None and gate.stride(-1) != 1):
        return None
    splits = _decode_splits(batch, k_cache.shape[2])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    part_o, part_lse = _decode_partials(q, splits, out)
    per_call = (q, page_table, seq_lens, out, part_o, part_lse) + (() if gate is None else (gate,))
    bound = [
        launch.bind(grid, args, per_call, **options)
        for launch, grid, args, options in _decode_launches(
            q, k_cache, v_cache, page_table, seq_lens, scale, splits, gate, out, part_o, part_lse
        )
    ]
    with_gate = gate is not None

    def attention(
        q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, gate: torch.Tensor | None
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        part_o, part_lse = _decode_partials(q, splits, out)
        tensors = (
            (q, page_table, seq_lens, out, part_o, part_lse, gate)
            if with_gate
            else (q, page_table, seq_lens, out, part_o, part_lse)
        )
        for launch in bound:
            launch(*tensors)
        return out

    return attention
