"""Triton KV write into pages and a decode step's KV indices, same signatures and semantics as
``kernels/kv_cache.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, wait_for_producer


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    stride_ch,
    D,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dst = slot * stride_cslot + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor
) -> None:
    tokens, kv_heads, dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    # [pages, page_size, Hkv, D] contiguous: slot = page * page_size + offset is one stride.
    _write_kv_kernel[(tokens, kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_ids,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        dim,
        BLOCK_D=next_pow2(dim),
        num_warps=2,
    )


@triton.jit
def _decode_kv_indices_kernel(
    pos_ptr, table_ptr, slot_ptr, len_ptr, B, stride_table, page_size, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < B
    wait_for_producer(USE_PDL)
    pos = tl.load(pos_ptr + rows, mask=mask, other=0)
    page = tl.load(table_ptr + rows * stride_table + pos // page_size, mask=mask, other=0).to(tl.int64)
    tl.store(slot_ptr + rows, page * page_size + pos % page_size, mask=mask)
    tl.store(len_ptr + rows, (pos + 1).to(tl.int32), mask=mask)


_DECODE_BLOCK = 256
_decode_kv_indices_launch = FastLaunch(_decode_kv_indices_kernel, pdl=True)


def decode_kv_indices_triton(
    positions: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel where the torch reference takes nine, each a launch on a graph step's critical
    path (measured: docs/benchmarks/kernel-choices-h200.md)."""
    rows = positions.shape[0]
    slots = torch.empty(rows, dtype=torch.int64, device=positions.device)
    lengths = torch.empty(rows, dtype=torch.int32, device=positions.device)
    if rows:
        if page_table.stride(1) != 1:
            page_table = page_table.contiguous()
        _decode_kv_indices_launch(
            (cdiv(rows, _DECODE_BLOCK),),
            positions,
            page_table,
            slots,
            lengths,
            rows,
            page_table.stride(0),
            page_size,
            _DECODE_BLOCK,
            num_warps=4,
        )
    return slots, lengths
