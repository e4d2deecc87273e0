"""Triton partial NeoX RoPE, same signature and semantics as ``kernels/rope.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import next_pow2


@triton.jit
def rotate_head(src_ptr, dst_ptr, cs_ptr, D, ROT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Copy one head of D values, rotating its first ROT dims (NeoX rotate_half).

    ``cs_ptr`` points at the position's row of cos_sin: ROT/2 cosines then ROT/2 sines."""
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, BLOCK_D)
    x = tl.load(src_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    in_rot = d < ROT
    first = d < half
    partner = tl.where(first, d + half, d - half)
    xp = tl.load(src_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
    freq = tl.where(first, d, d - half)
    cos = tl.load(cs_ptr + freq, mask=in_rot, other=1.0)
    sin = tl.load(cs_ptr + half + freq, mask=in_rot, other=0.0)
    rotated = tl.where(first, x * cos - xp * sin, x * cos + xp * sin)
    y = tl.where(in_rot, rotated, x)
    tl.store(dst_ptr + d, y.to(dst_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _rope_kernel(
    x_ptr,
    y_ptr,
    pos_ptr,
    cs_ptr,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_cs,
    D,
    ROT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    rotate_head(
        x_ptr + t * stride_xt + h * stride_xh,
        y_ptr + t * stride_yt + h * D,
        cs_ptr + pos * stride_cs,
        D,
        ROT=ROT,
        BLOCK_D=BLOCK_D,
    )


def apply_rope_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    cos_sin = cos_sin.contiguous()
    _rope_kernel[(tokens, heads)](
        x,
        y,
        positions,
        cos_sin,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        cos_sin.stride(0),
        dim,
        ROT=cos_sin.shape[1],
        BLOCK_D=next_pow2(dim),
        num_warps=2,
    )
    return y
