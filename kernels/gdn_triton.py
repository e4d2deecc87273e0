"""Triton Gated DeltaNet ops: gates, the delta-rule decode step and the prefill recurrence.

Same signatures and semantics as ``kernels/gdn.py``. State layout ``[slots, Hv, dk, dv]`` fp32.
The prefill here is a sequential recurrence over the tokens; the model's prefill goes through
``kernels/gdn_prefill_triton.py``, which runs fla-core's chunked (WY) kernels when it is installed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.gdn import RECURRENT_STATE_DTYPES
from phalanx.kernels.launch import cdiv, next_pow2


@triton.jit
def softplus_gate(a, dt_bias, a_log):
    """g = -exp(A_log) * softplus(a + dt_bias), softplus with threshold 20 (fp32)."""
    x = a + dt_bias
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return -tl.exp(a_log) * sp


@triton.jit
def l2_normalize(x, scale):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6) * scale


@triton.jit
def delta_rule_update(s_ptrs, s_mask, q, k, v, g, beta):
    """One token of the gated delta rule on a [dk, BV] state tile (fp32, in place); returns o."""
    s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    s = s * tl.exp(g)
    kv = tl.sum(s * k[:, None], axis=0)
    delta = beta * (v - kv)
    s = s + k[:, None] * delta[None, :]
    # Threads sharing an element must all have read it before any writes it back.
    tl.debug_barrier()
    tl.store(s_ptrs, s, mask=s_mask)
    return tl.sum(s * q[:, None], axis=0)


@triton.jit
def _gating_kernel(
    a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, N, HV, stride_a, stride_b, BLOCK: tl.constexpr
):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N * HV
    row = idx // HV
    h = idx % HV
    a = tl.load(a_ptr + row * stride_a + h, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + h, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + h, mask=mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(g_ptr + idx, softplus_gate(a, dt, a_log), mask=mask)
    tl.store(beta_ptr + idx, tl.sigmoid(b), mask=mask)


def gdn_gating_triton(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n, hv = a.shape
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    g = torch.empty((n, hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((n, hv), dtype=torch.float32, device=a.device)
    if n == 0:
        return g, beta
    block = 1024
    _gating_kernel[(cdiv(n * hv, block),)](
        a, b, A_log, dt_bias, g, beta, n, hv, a.stride(0), b.stride(0), BLOCK=block, num_warps=4
    )
    return g, beta


def _check_recurrent_state(state: torch.Tensor, hv: int, dk: int, dv: int) -> None:
    if (
        not state.is_contiguous()
        or state.shape[1:] != (hv, dk, dv)
        or state.dtype not in RECURRENT_STATE_DTYPES
    ):
        raise ValueError(
            f"recurrent state must be contiguous float32 or bfloat16 [slots, {hv}, {dk}, {dv}], got "
            f"{state.dtype} {tuple(state.shape)}"
        )


@triton.jit
def _delta_rule_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    o_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_betab,
    stride_slot,
    HV,
    DK,
    DV,
    scale,
    RATIO: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // RATIO
    dk = tl.arange(0, BK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_mask = dk < DK
    v_mask = dv < DV
    q = tl.load(q_ptr + b * stride_qb + kh * stride_qh + dk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + kh * stride_kh + dk, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + dv, mask=v_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_betab + h).to(tl.float32)
    slot = tl.load(slots_ptr + b)
    s_ptrs = state_ptr + slot * stride_slot + h * DK * DV + dk[:, None] * DV + dv[None, :]
    o = delta_rule_update(
        s_ptrs, k_mask[:, None] & v_mask[None, :], l2_normalize(q, scale), l2_normalize(k, 1.0), v, g, beta
    )
    tl.store(o_ptr + (b * HV + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=v_mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gated_delta_rule_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    batch, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _check_recurrent_state(state, hv, dk, dv)
    q, k, v, g, beta = (_last_dim_contiguous(t) for t in (q, k, v, g, beta))
    o = torch.empty((batch, hv, dv), dtype=v.dtype, device=v.device)
    if batch == 0:
        return o
    bv = min(next_pow2(dv), 32)
    _delta_rule_decode_kernel[(batch, hv, cdiv(dv, bv))](
        q,
        k,
        v,
        g,
        beta,
        state,
        state_slots,
        o,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        state.stride(0),
        hv,
        dk,
        dv,
        dk**-0.5,
        RATIO=hv // hk,
        BK=next_pow2(dk),
        BV=bv,
        num_warps=4,
    )
    return o


@triton.jit
def _delta_rule_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    cu_ptr,
    init_ptr,
    o_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_betat,
    stride_slot,
    HV,
    DK,
    DV,
    scale,
    RATIO: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // RATIO
    dk = tl.arange(0, BK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_mask = dk < DK
    v_mask = dv < DV
    s_mask = k_mask[:, None] & v_mask[None, :]
    bos = tl.load(cu_ptr + i)
    eos = tl.load(cu_ptr + i + 1)
    slot = tl.load(slots_ptr + i)
    has_init = tl.load(init_ptr + i) != 0
    s_ptrs = state_ptr + slot * stride_slot + h * DK * DV + dk[:, None] * DV + dv[None, :]
    # where, not a mask: a slot without history may hold anything, NaN included.
    s = tl.where(has_init, tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32), 0.0)
    for t in range(bos, eos):
        q = tl.load(q_ptr + t * stride_qt + kh * stride_qh + dk, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + kh * stride_kh + dk, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_betat + h).to(tl.float32)
        q = l2_normalize(q, scale)
        k = l2_normalize(k, 1.0)
        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (t * HV + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=v_mask)
    tl.debug_barrier()
    tl.store(s_ptrs, s, mask=s_mask)


def gated_delta_rule_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """The prefill as a token-by-token recurrence (one program per chunk, head and dv block): the
    path without fla-core (``gdn_prefill_triton`` runs fla-core's chunked kernels when installed)."""
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _check_recurrent_state(state, hv, dk, dv)
    q, k, v, g, beta = (_last_dim_contiguous(t) for t in (q, k, v, g, beta))
    device = v.device
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    init = has_initial_state.to(device=device, dtype=torch.int32)
    o = torch.empty((tokens, hv, dv), dtype=v.dtype, device=device)
    n_chunks = cu.shape[0] - 1
    if n_chunks == 0:
        return o
    bv = min(next_pow2(dv), 32)
    _delta_rule_prefill_kernel[(n_chunks, hv, cdiv(dv, bv))](
        q,
        k,
        v,
        g,
        beta,
        state,
        state_slots.to(device),
        cu,
        init,
        o,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        state.stride(0),
        hv,
        dk,
        dv,
        dk**-0.5,
        RATIO=hv // hk,
        BK=next_pow2(dk),
        BV=bv,
        num_warps=4,
    )
    return o
