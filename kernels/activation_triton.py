"""Triton SiLU-and-mul, same signature and semantics as ``kernels/activation.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, wait_for_producer


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


_silu_and_mul_launch = FastLaunch(_silu_and_mul_kernel, pdl=True)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    n, two_inter = x.shape
    inter = two_inter // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    block = min(next_pow2(inter), 2048)
    _silu_and_mul_launch((n, cdiv(inter, block)), x, y, inter, x.stride(0), y.stride(0), block, num_warps=4)
    return y
