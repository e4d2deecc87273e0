"""Decode linears bound to their weight and to one input layout (``kernels/bound.py``'s linears).

The binding half of ``kernels/linear_triton.py``: it launches what that module's ``_launch``
would for the same tuning key, with the launch worked out once instead of on every call.

- A key the race gave to Triton launches its tuned kernel through ``FastLaunch.bind``.
- A key the race gave to cuBLAS calls ``torch.mm`` on the weight's transpose, made once: at batch
  64 cuBLAS answers 64 calls a step, whose host time the general op's checks would dominate
  (measured: docs/benchmarks/kernel-choices-h200.md). So do rows past Triton's (``ops.triton_linear_rows``),
  whose tuning key is the widest Triton bucket's: a race won by Triton at 64 rows says nothing of 128.
- A pre-normed linear over one row (K up to ``NORMED_MAX_K``) is the pre-normed GEMV. Over more
  rows it is the general path's pair: the bound norm kernel (``norms_triton.bind_rms_norm``),
  then the bound linear of the normed rows, whose own key the race decided.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from phalanx.kernels import linear_gemv_triton, ops
from phalanx.kernels import linear_triton as lt
from phalanx.kernels.activation_triton import silu_and_mul_triton
from phalanx.kernels.norms_triton import bind_rms_norm

# (x, residual) -> (y, h): h is the residual stream a pre-norm leaves (x itself without one).
BoundLinear = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
# A pre-norm's (weight, eps, residual): weight None where it is folded into the linear's columns.
Norm = tuple[torch.Tensor | None, float, torch.Tensor | None]


def bind_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    norm: Norm | None = None,
) -> BoundLinear | None:
    """The linear on ``w`` (``linear_triton``'s ops: plain, fp32 out, SiLU-and-mul, pre-normed)
    bound to x's shape and layout: a function of (x, residual) -> (y, h) that allocates its
    outputs and launches what the general op would. ``norm`` = (weight, eps, residual) makes it
    pre-normed; every later call's residual must have this one's layout, and be None exactly when
    this one is. None where no binding applies: a key not yet tuned and raced (bind after the
    op's first call), empty shapes, rows that are not contiguous."""
    m, k = x.shape
    if m == 0 or w.shape[0] == 0 or x.stride(1) != 1:
        return None
    n_out = lt._gate_up_rows(w) if silu_mul else w.shape[0]
    if norm is None:
        return _bind_plain(x, w, n_out, silu_mul, out_dtype)
    if m == 1 and k <= linear_gemv_triton.NORMED_MAX_K:
        return _bind_normed_gemv(x, w, n_out, silu_mul, norm)
    return _bind_norm_then_linear(x, w, n_out, silu_mul, norm)


def _bind_plain(
    x: torch.Tensor, w: torch.Tensor, n_out: int, silu_mul: bool, out_dtype: torch.dtype | None
) -> BoundLinear | None:
    m = x.shape[0]
    y_dtype = x.dtype if out_dtype is None else out_dtype
    key = lt._tuning_key(x, n_out, silu_mul, None, y_dtype)
    if lt._cublas_faster.get(key) or not ops.triton_linear_rows(m):
        return _bind_cublas(w, silu_mul, y_dtype)
    if not _tuned(key):
        return None
    y = torch.empty((m, n_out), dtype=y_dtype, device=x.device)
    bound = _bind_kernel(key, x, w, y, None, (x, y))

    def plain(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty((m, n_out), dtype=y_dtype, device=x.device)
        bound(x, y)
        return y, x

    return plain


def _tuned(key: tuple[object, ...]) -> bool:
    """Whether the key's Triton kernel is tuned and won the race (under the interpreter, always)."""
    return lt._INTERPRET or (lt._cublas_faster.get(key) is False and key in lt._best_configs)


def _bind_kernel(
    key: tuple[object, ...],
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    pre_norm: lt.PreNorm | None,
    per_call: tuple[torch.Tensor, ...],
) -> Callable[..., None]:
    """The key's tuned kernel on these tensors, bound with ``per_call`` left open."""
    grid_of, args, constexprs, _ = lt._arguments(key, x, w, y, pre_norm)
    launch, meta, constexpr_values, options = lt._prepare(key[0], key, len(args), constexprs)
    return launch.bind(grid_of(meta), (*args, *constexpr_values), per_call, **options)


def _bind_cublas(w: torch.Tensor, silu_mul: bool, y_dtype: torch.dtype) -> BoundLinear:
    """``linear_triton._cublas`` for a plain linear: the same mm (``F.linear`` is mm on the
    weight's transpose), then the SiLU-and-mul kernel where the op fuses it."""
    w_t = w.t()
    if y_dtype != w.dtype:  # cuBLAS stores its fp32 sums (the vocab head)
        return lambda x, residual: (torch.mm(x, w_t, out_dtype=y_dtype), x)
    if silu_mul:
        return lambda x, residual: (silu_and_mul_triton(torch.mm(x, w_t)), x)
    return lambda x, residual: (torch.mm(x, w_t), x)


def _bind_normed_gemv(
    x: torch.Tensor, w: torch.Tensor, n_out: int, silu_mul: bool, norm: Norm
) -> BoundLinear | None:
    residual = norm[2]
    if residual is not None and not residual.is_contiguous():
        return None  # the general path would copy it first
    pre_norm = lt.PreNorm.build(x, *norm)
    key = lt._tuning_key(x, n_out, silu_mul, pre_norm, x.dtype)
    if not _tuned(key):
        return None
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    bound = _bind_kernel(key, x, w, y, pre_norm, (x, y, pre_norm.residual, pre_norm.h))
    zeros = lt._zeros_like(x)  # the first layer's residual (outside capture: bind there only)

    def pre_normed(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
        h = torch.empty_like(x)
        bound(x, y, zeros if residual is None else residual, h)
        return y, h

    return pre_normed


def _bind_norm_then_linear(
    x: torch.Tensor, w: torch.Tensor, n_out: int, silu_mul: bool, norm: Norm
) -> BoundLinear | None:
    """``linear_triton._pre_normed`` past one row: the norm kernel, then the linear of its rows."""
    weight, eps, residual = norm
    normed_rows = bind_rms_norm(x, weight, eps, residual)
    linear = _bind_plain(torch.empty_like(x), w, n_out, silu_mul, None)  # the norm's output layout
    if normed_rows is None or linear is None:
        return None

    def norm_then_linear(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        normed, h = normed_rows(x, residual)
        return linear(normed, None)[0], h

    return norm_then_linear
