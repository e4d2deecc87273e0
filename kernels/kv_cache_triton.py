"""Triton KV write into pages, same signature and semantics as ``kernels/kv_cache.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import next_pow2


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
