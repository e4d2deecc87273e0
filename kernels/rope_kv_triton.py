"""``norm_rope_write_kv`` (see ``kernels/rope_kv.py``) as one Triton kernel.

One program per (token, head) over the q heads then the KV heads: it normalises the head, rotates
its first rotary_dim dims and stores it (q to the output, k and v into their cache slot). Under PDL
everything but the head itself is read before waiting for the linear before it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, next_pow2, wait_for_producer


@triton.jit
def _rope_dims(D: tl.constexpr, ROT: tl.constexpr):
    """Each dim, whether it is in the rotation's first half, whether it is rotated, its partner."""
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, D)
    first = d < half
    in_rot = d < ROT
    return d, first, in_rot, tl.where(first, d + half, tl.where(in_rot, d - half, d))


@triton.jit
def _rope_operands(w_ptr, cs_row, D: tl.constexpr, ROT: tl.constexpr):
    """What a head's norm and rotation read besides the head: the norm weight at each dim and at
    its rotation partner, and the position's cos and sin."""
    half: tl.constexpr = ROT // 2
    d, first, in_rot, partner = _rope_dims(D=D, ROT=ROT)
    w = tl.load(w_ptr + d).to(tl.float32)
    w_partner = tl.load(w_ptr + partner).to(tl.float32)
    freq = tl.where(first, d, d - half)
    cos = tl.load(cs_row + freq, mask=in_rot, other=1.0)
    sin = tl.load(cs_row + half + freq, mask=in_rot, other=0.0)
    return w, w_partner, cos, sin


@triton.jit
def _norm_rope_head(src, w, w_partner, cos, sin, dst, eps, D: tl.constexpr, ROT: tl.constexpr):
    d, first, in_rot, partner = _rope_dims(D=D, ROT=ROT)
    x = tl.load(src + d).to(tl.float32)
    xp = tl.load(src + partner).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    # Round the normalised values to the model dtype, as the unfused norm's output is.
    n = (x * inv * (1.0 + w)).to(dst.dtype.element_ty).to(tl.float32)
    npart = (xp * inv * (1.0 + w_partner)).to(dst.dtype.element_ty).to(tl.float32)
    y = tl.where(first, n * cos - npart * sin, n * cos + npart * sin)
    tl.store(dst + d, tl.where(in_rot, y, n).to(dst.dtype.element_ty))


@triton.jit
def _norm_rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cs_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cslot,
    stride_ch,
    eps,
    H,
    D: tl.constexpr,
    ROT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    # Before the wait: the position, slot, norm weights and cos/sin. The positions and slots come
    # from kernels at least two launches back (the rule is in kernels/launch.py); only q, k and v
    # (the linear just before) are read after it.
    cs_row = cs_ptr + tl.load(pos_ptr + t) * stride_cs
    if head < H:
        w, w_partner, cos, sin = _rope_operands(qw_ptr, cs_row, D=D, ROT=ROT)
        wait_for_producer(USE_PDL)
        q_src = q_ptr + t * stride_qt + head * stride_qh
        _norm_rope_head(q_src, w, w_partner, cos, sin, out_ptr + (t * H + head) * D, eps, D=D, ROT=ROT)
    else:
        kvh = head - H
        dst = tl.load(slot_ptr + t) * stride_cslot + kvh * stride_ch
        w, w_partner, cos, sin = _rope_operands(kw_ptr, cs_row, D=D, ROT=ROT)
        wait_for_producer(USE_PDL)
        k_src = k_ptr + t * stride_kt + kvh * stride_kh
        _norm_rope_head(k_src, w, w_partner, cos, sin, kc_ptr + dst, eps, D=D, ROT=ROT)
        d = tl.arange(0, D)
        v = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + d)
        tl.store(vc_ptr + dst + d, v.to(vc_ptr.dtype.element_ty))


_norm_rope_write_kv_launch = FastLaunch(_norm_rope_write_kv_kernel, pdl=True)


def norm_rope_write_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    tokens, heads, dim = q.shape
    if dim != next_pow2(dim):
        raise ValueError(f"norm_rope_write_kv needs a power-of-two head_dim, got {dim}")
    if not k_cache.is_contiguous() or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"KV caches must be contiguous with one layout, got {k_cache.stride()} / {v_cache.stride()}"
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    cos_sin = cos_sin.contiguous()
    grid, args = _arguments(q, k, v, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, slot_ids, out)
    _norm_rope_write_kv_launch(grid, *args, num_warps=2)
    return out


def _arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor,
) -> tuple[tuple[int, int], tuple[object, ...]]:
    """(grid, arguments) of the kernel on checked tensors with contiguous head vectors."""
    tokens, heads, dim = q.shape
    args = (
        q,
        k,
        v,
        q_norm,
        k_norm,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        slot_ids,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        eps,
        heads,
        dim,
        cos_sin.shape[1],
    )
    return (tokens, heads + k.shape[1]), args


BoundNormRopeWriteKv = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def bind_norm_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
) -> BoundNormRopeWriteKv | None:
    """``norm_rope_write_kv`` bound to one layer's norms, RoPE table and caches and to the layout
    of these inputs: a function of (q, k, v, positions, slot_ids) -> q out that allocates the
    output and launches through ``FastLaunch.bind``. None where the general path would copy an
    input first, or for no tokens."""
    tokens = q.shape[0]
    if tokens == 0 or any(t.stride(-1) != 1 for t in (q, k, v)) or not cos_sin.is_contiguous():
        return None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid, args = _arguments(q, k, v, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, slot_ids, out)
    bound = _norm_rope_write_kv_launch.bind(grid, args, (q, k, v, positions, slot_ids, out), num_warps=2)
    shape, dtype, device = q.shape, q.dtype, q.device

    def norm_rope_write_kv(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        bound(q, k, v, positions, slot_ids, out)
        return out

    return norm_rope_write_kv
