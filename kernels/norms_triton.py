"""Triton RMSNorm kernels: Qwen's (1 + w) RMSNorm with the residual add fused, and the gated
RMSNorm of the Gated DeltaNet output. Same signatures and semantics as ``kernels/norms.py``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, wait_for_producer


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    H,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    # Before the wait: the weight, and the residual, which a decoder's previous pre-norm wrote at
    # least two launches back (see ``kernels/launch.py``); x, the kernel just before's, after it.
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    wait_for_producer(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the model dtype first: the residual stream is stored in that dtype.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = xf * inv
    if HAS_WEIGHT:
        y = y * (1.0 + w)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


_rms_norm_launch = FastLaunch(_rms_norm_kernel, pdl=True)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rms_norm_arguments(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None
) -> tuple[tuple[object, ...], dict[str, int], torch.Tensor, torch.Tensor]:
    """(the norm kernel's arguments, its launch options, y, h): y new, h new unless residual is
    None (then x itself)."""
    hidden = x.shape[1]
    y = torch.empty_like(x)
    if residual is None:
        h, res = x, x
    else:
        h, res = torch.empty_like(x), residual
    block = next_pow2(hidden)
    args = (
        x,
        res,
        x if weight is None else weight,  # never read without a weight
        y,
        h,
        hidden,
        x.stride(0),
        res.stride(0),
        y.stride(0),
        h.stride(0),
        eps,
        residual is not None,
        weight is not None,
        block,
    )
    return args, {"num_warps": min(max(block // 256, 1), 8)}, y, h


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rows(x)
    args, options, y, h = _rms_norm_arguments(x, weight, eps, None if residual is None else _rows(residual))
    if x.shape[0]:
        _rms_norm_launch((x.shape[0],), *args, **options)
    return y, h


BoundRmsNorm = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def bind_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None
) -> BoundRmsNorm | None:
    """``rms_norm_triton`` bound to the weight and to the layout of x and residual: a function of
    (x, residual) -> (y, h) that allocates y (and h) and launches through ``FastLaunch.bind``.
    Every later call's x and residual must have these ones' layouts, and residual is None in them
    exactly when it is here (the first layer's norm, without the residual add). None for no rows,
    or rows the general path would copy first."""
    rows = x.shape[0]
    if rows == 0 or x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        return None
    args, options, y, h = _rms_norm_arguments(x, weight, eps, residual)
    if residual is None:
        first_layer = _rms_norm_launch.bind((rows,), args, (x, y), **options)

        def without_residual(
            x: torch.Tensor, residual: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.empty_like(x)
            first_layer(x, y)
            return y, x

        return without_residual
    launch = _rms_norm_launch.bind((rows,), args, (x, residual, y, h), **options)

    def with_residual(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = torch.empty_like(x), torch.empty_like(x)
        launch(x, residual, y, h)
        return y, h

    return with_residual


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    n_rows,
    HEADS,
    D,
    stride_xn,
    stride_xh,
    stride_zn,
    stride_zh,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n, h = rows // HEADS, rows % HEADS
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    x = tl.load(x_ptr + (n * stride_xn + h * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + (n * stride_zn + h * stride_zh)[:, None] + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    # The normalised x is rounded to the input dtype before the gate, as the reference does.
    normed = (xf * inv[:, None]).to(x.dtype).to(tl.float32)
    zf = z.to(tl.float32)
    y = w[None, :] * normed * (zf * tl.sigmoid(zf))
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


_gated_rms_norm_launch = FastLaunch(_gated_rms_norm_kernel, pdl=True)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n, heads, dv = x.shape
    # Row and head strides are passed through: z is usually a column slice of a fused projection.
    if x.stride(-1) != 1:
        x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    y = torch.empty((n, heads, dv), dtype=x.dtype, device=x.device)
    n_rows = n * heads
    if n_rows == 0:
        return y
    rows = 16
    _gated_rms_norm_launch(
        (cdiv(n_rows, rows),),
        x,
        z,
        weight,
        y,
        n_rows,
        heads,
        dv,
        x.stride(0),
        x.stride(1),
        z.stride(0),
        z.stride(1),
        eps,
        rows,
        next_pow2(dv),
        num_warps=4,
    )
    return y
