"""The Gated DeltaNet decode step (see ``kernels/gdn_step.py``) on CUDA.

Every batch size runs the split path (``kernels/gdn_recurrent_triton.py``): the conv, the
recurrence split over dv, the gated norm. Its [dk, BV] state tiles give the step dv / BV times more
programs than one per (row, key head), which is what a small batch lacks: in CUDA graphs on the
H200 (`phalanx bench gdn`, 4B heads, 2026-11-29) the split path took 8.6 µs a layer at batch 1
against 16.1 µs for the fused kernel below, and was faster at every batch up to 16; from 16 rows
the state traffic dominates and the tiles keep enough of it in flight to approach the copy
bandwidth. Graph and eager take the same path, so their tokens stay equal.

The fused kernel, one program per (batch row, key head), convolves the key head's q and k
channels once (so their conv state is shifted exactly once), then, for each of the Hv/Hk value
heads that read them, convolves the v channels, computes the gates, runs the delta-rule step on
the whole [dk, dv] fp32 state and writes the gated-RMSNorm output. It is one launch where the
split path takes three (eager decode pays ~14 µs of host time a launch), and it stays as the
baseline ``phalanx bench gdn`` measures the split path against."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.conv1d_triton import conv_decode_channels
from kernels.gdn_recurrent_triton import check_step_states, gdn_decode_step_split
from kernels.gdn_step import gdn_split_sizes
from kernels.gdn_triton import delta_rule_update, l2_normalize, softplus_gate
from kernels.launch import FastLaunch, next_pow2, wait_for_producer


@triton.jit
def _gdn_decode_step_kernel(
    x_ptr,
    cw_ptr,
    cs_ptr,
    z_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dt_ptr,
    nw_ptr,
    state_ptr,
    slots_ptr,
    y_ptr,
    stride_x,
    stride_cs,
    stride_z,
    stride_a,
    stride_b,
    stride_slot,
    eps,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    row = tl.program_id(0)
    kh = tl.program_id(1)
    ratio: tl.constexpr = HV // HK
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    k_mask = dk < DK
    v_mask = dv < DV
    slot = tl.load(slots_ptr + row)
    x_row = x_ptr + row * stride_x
    cs_row = cs_ptr + slot * stride_cs
    # Conv outputs are rounded to the model dtype, as the unfused chain stores them.
    q = conv_decode_channels(x_row, cw_ptr, cs_row, kh * DK + dk, k_mask, K=K)
    k = conv_decode_channels(x_row, cw_ptr, cs_row, HK * DK + kh * DK + dk, k_mask, K=K)
    q = l2_normalize(q.to(y_ptr.dtype.element_ty).to(tl.float32), scale)
    k = l2_normalize(k.to(y_ptr.dtype.element_ty).to(tl.float32), 1.0)
    nw = tl.load(nw_ptr + dv, mask=v_mask, other=0.0).to(tl.float32)
    for r in tl.static_range(ratio):
        h = kh * ratio + r
        v = conv_decode_channels(x_row, cw_ptr, cs_row, 2 * HK * DK + h * DV + dv, v_mask, K=K)
        v = v.to(y_ptr.dtype.element_ty).to(tl.float32)
        a = tl.load(a_ptr + row * stride_a + h).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + h).to(tl.float32)
        g = softplus_gate(a, tl.load(dt_ptr + h).to(tl.float32), tl.load(alog_ptr + h).to(tl.float32))
        beta = tl.sigmoid(b)
        s_ptrs = state_ptr + slot * stride_slot + h * DK * DV + dk[:, None] * DV + dv[None, :]
        o = delta_rule_update(s_ptrs, k_mask[:, None] & v_mask[None, :], q, k, v, g, beta)
        o = o.to(y_ptr.dtype.element_ty).to(tl.float32)
        z = tl.load(z_ptr + row * stride_z + h * DV + dv, mask=v_mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)
        y = nw * (o * inv) * (z * tl.sigmoid(z))
        tl.store(y_ptr + (row * HV + h) * DV + dv, y.to(y_ptr.dtype.element_ty), mask=v_mask)


_fused_step_launch = FastLaunch(_gdn_decode_step_kernel, pdl=True)


def gdn_decode_step_triton(mixed_qkv: torch.Tensor, *args: Any) -> torch.Tensor:
    """``gdn_decode_step`` (signature in ``kernels/gdn_step.py``): the split path."""
    return gdn_decode_step_split(mixed_qkv, *args)


def gdn_decode_step_fused(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """``gdn_decode_step`` as the single fused kernel (any batch; the small-batch path)."""
    batch, conv_dim = mixed_qkv.shape
    hk, dk, hv, dv = gdn_split_sizes(conv_dim, state)
    kernel = conv_weight.shape[-1]
    check_step_states(conv_state, state, conv_dim, kernel)
    if mixed_qkv.stride(-1) != 1:
        mixed_qkv = mixed_qkv.contiguous()
    if z.stride(-1) != 1 or z.stride(-2) != dv:
        z = z.contiguous()
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    y = torch.empty((batch, hv, dv), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if batch == 0:
        return y
    _fused_step_launch(
        (batch, hk),
        mixed_qkv,
        conv_weight if conv_weight.is_contiguous() else conv_weight.contiguous(),
        conv_state,
        z,
        a,
        b,
        A_log,
        dt_bias,
        norm_weight,
        state,
        state_slots,
        y,
        mixed_qkv.stride(0),
        conv_state.stride(0),
        z.stride(0),
        a.stride(0),
        b.stride(0),
        state.stride(0),
        eps,
        dk**-0.5,
        hk,
        hv,
        dk,
        dv,
        kernel,
        next_pow2(dk),
        next_pow2(dv),
        num_warps=8,
    )
    return y
