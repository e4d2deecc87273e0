"""The Gated DeltaNet decode step (see ``kernels/gdn_step.py``) on CUDA, by batch size.

Small batches run one fused kernel, one program per (batch row, key head): it convolves the key
head's q and k channels once (so their conv state is shifted exactly once), then, for each of the
Hv/Hk value heads that read them, convolves the v channels, computes the gates, runs the
delta-rule step on the whole [dk, dv] fp32 state and writes the gated-RMSNorm output. One launch
matters most at batch 1 in eager mode.

From ``SPLIT_MIN_BATCH`` rows the state traffic dominates and the step runs as three kernels with
the recurrence split over dv (``kernels/gdn_recurrent_triton.py``), which keeps enough state
tiles in flight to approach the copy bandwidth."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.conv1d_triton import conv_decode_channels
from kernels.gdn_recurrent_triton import check_step_states, gdn_decode_step_split
from kernels.gdn_step import gdn_split_sizes
from kernels.gdn_triton import delta_rule_update, l2_normalize, softplus_gate
from kernels.launch import FastLaunch, next_pow2

# Batch rows from which the split path runs (a graph bucket boundary).
SPLIT_MIN_BATCH = 16


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
):
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


_fused_step_launch = FastLaunch(_gdn_decode_step_kernel)


def gdn_decode_step_triton(mixed_qkv: torch.Tensor, *args: Any) -> torch.Tensor:
    """``gdn_decode_step`` (signature in ``kernels/gdn_step.py``): the fused kernel below
    ``SPLIT_MIN_BATCH`` rows, the split path from there."""
    step = gdn_decode_step_split if mixed_qkv.shape[0] >= SPLIT_MIN_BATCH else gdn_decode_step_fused
    return step(mixed_qkv, *args)


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
