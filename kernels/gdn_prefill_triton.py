"""A Gated DeltaNet layer's prefill from its conv output: gates and the chunked delta rule.

Same signature and semantics as ``kernels/gdn.py`` ``gdn_prefill_ref``. With fla-core installed
(the ``cuda`` extra) and the batch's chunk bounds known on the host (``Varlen``), one kernel turns
the conv output into everything fla-core's chunked forward reads (q and k L2-normalised, q, k and v
in fp32, the gates, and the decay's running sum within each 64-token chunk), then fla-core's
forward steps run one by one. That single launch replaces seven, three of them through fla-core's
Python wrappers, which cost more host time than their kernels take on the GPU in a short prefill
(docs/benchmarks/prefill-h200.md). Without fla-core: the gates kernel and the token recurrence.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from phalanx.kernels.gdn import gated_delta_rule_prefill_ref, split_conv_output
from phalanx.kernels.gdn_triton import (
    _check_recurrent_state,
    gated_delta_rule_prefill_triton,
    gdn_gating_triton,
    softplus_gate,
)
from phalanx.kernels.launch import FastLaunch, next_pow2
from phalanx.kernels.varlen import GDN_CHUNK, StateCaptures, Varlen


@functools.cache
def fla_core_available() -> bool:
    """Whether fla-core's kernels can run here (installed, and not under the Triton interpreter);
    the first call also readies fla-core's launches (its config cache's key, ``AutotunedLaunch``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    # fla-core's backend dispatch wraps each of its calls in torch.compiler.disable and a scan of
    # alternative backends; we only run its Triton kernels, and a prefill makes ~100 such calls.
    # Read when fla-core is first imported (here, in a rank); a value the user set is kept.
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    _skip_disabled_config_cache()
    _launch_kept_configs()
    return True


def _launch_kept_configs() -> None:
    """The kernels of the three forward steps we run launch through ``AutotunedLaunch``."""
    import importlib

    from phalanx.kernels.fla_launch import install

    names = (
        "gated_delta_rule.chunk_fwd",
        "gated_delta_rule.wy_fast",
        "common.chunk_delta_h",
        "common.chunk_o",
    )
    install(*(importlib.import_module(f"fla.ops.{name}") for name in names))


def _skip_disabled_config_cache() -> None:
    """With fla-core's config cache off (``FLA_CACHE_MODE`` unset: its default), its autotuner's
    ``run`` still builds and hashes a cache key on every launch, then runs Triton's; a prefill makes
    ~100 such launches, so they go straight to Triton's autotuner, which is what runs anyway."""
    from triton.runtime.autotuner import Autotuner

    try:
        from fla.ops.utils import cache
    except ImportError:  # an fla-core without the config cache
        return
    mode = getattr(cache, "FLA_CACHE_MODE", None)
    if getattr(mode, "value", None) == "disabled" and hasattr(cache, "CachedAutotuner"):
        cache.CachedAutotuner.run = Autotuner.run


@triton.jit
def _store_l2_normalised(src, dst, rows, stride_src, HK, live, DK: tl.constexpr, BK: tl.constexpr):
    """One head's [BT, DK] block of ``src`` (row stride ``stride_src``), each row divided by its
    L2 norm as fla-core's l2norm does (1 / sqrt(sum + 1e-6)), stored fp32 into ``dst`` [T, HK, DK]."""
    dk = tl.arange(0, BK)
    mask = live[:, None] & (dk < DK)[None, :]
    x = tl.load(src + rows[:, None] * stride_src + dk[None, :], mask=mask, other=0.0).to(tl.float32)
    x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]
    tl.store(dst + rows[:, None] * (HK * DK) + dk[None, :], x, mask=mask)


@triton.jit
def _chunk_inputs_kernel(
    mixed_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dt_ptr,
    cu_ptr,
    chunks_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    stride_mixed,
    stride_a,
    stride_b,
    HK,
    HV,
    g_scale,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Program (chunk, value head h): that 64-token chunk's gates, cumulative decay and v for head
    h, and its q and k for key head h when h < HK."""
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    sequence = tl.load(chunks_ptr + 2 * chunk)
    index = tl.load(chunks_ptr + 2 * chunk + 1)
    end = tl.load(cu_ptr + sequence + 1)
    rows = tl.load(cu_ptr + sequence) + index * BT + tl.arange(0, BT)
    live = rows < end
    a = tl.load(a_ptr + rows * stride_a + h, mask=live, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_b + h, mask=live, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    dt = tl.load(dt_ptr + h).to(tl.float32)
    g = tl.where(live, softplus_gate(a, dt, a_log), 0.0)
    tl.store(g_ptr + rows * HV + h, tl.cumsum(g, axis=0) * g_scale, mask=live)
    tl.store(beta_ptr + rows * HV + h, tl.sigmoid(b), mask=live)
    dv = tl.arange(0, BV)
    v_mask = live[:, None] & (dv < DV)[None, :]
    v_src = mixed_ptr + 2 * HK * DK + h * DV
    v = tl.load(v_src + rows[:, None] * stride_mixed + dv[None, :], mask=v_mask, other=0.0)
    tl.store(v_ptr + rows[:, None] * (HV * DV) + h * DV + dv[None, :], v.to(tl.float32), mask=v_mask)
    if h < HK:
        _store_l2_normalised(mixed_ptr + h * DK, q_ptr + h * DK, rows, stride_mixed, HK, live, DK, BK)
        _store_l2_normalised(mixed_ptr + (HK + h) * DK, k_ptr + h * DK, rows, stride_mixed, HK, live, DK, BK)


_chunk_inputs_launch = FastLaunch(_chunk_inputs_kernel)


def gdn_chunk_inputs_triton(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    key_heads: int,
    key_dim: int,
    varlen: Varlen,
    g_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the conv output ``mixed`` [T, q | k | v] and the gate inputs ``a``, ``b`` [T, Hv]
    (column slices are fine): q, k [T, Hk, dk] L2-normalised, v [T, Hv, dv], g [T, Hv] the log
    decay summed from the start of its 64-token chunk and scaled by ``g_scale``, beta [T, Hv];
    all fp32 and contiguous."""
    tokens, value_heads = a.shape
    value_dim = (mixed.shape[1] - 2 * key_heads * key_dim) // value_heads
    if mixed.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("gdn_chunk_inputs needs unit column strides in mixed, a and b")
    f32 = {"dtype": torch.float32, "device": mixed.device}
    q = torch.empty((tokens, key_heads, key_dim), **f32)
    k = torch.empty((tokens, key_heads, key_dim), **f32)
    v = torch.empty((tokens, value_heads, value_dim), **f32)
    g = torch.empty((tokens, value_heads), **f32)
    beta = torch.empty((tokens, value_heads), **f32)
    chunk_count = varlen.gdn_chunks.shape[0]
    if chunk_count:
        _chunk_inputs_launch(
            (chunk_count, value_heads),
            mixed,
            a,
            b,
            A_log,
            dt_bias,
            varlen.cu_seqlens_long,
            varlen.gdn_chunks,
            q,
            k,
            v,
            g,
            beta,
            mixed.stride(0),
            a.stride(0),
            b.stride(0),
            key_heads,
            value_heads,
            g_scale,
            key_dim,
            value_dim,
            GDN_CHUNK,
            next_pow2(key_dim),
            next_pow2(value_dim),
            num_warps=4,
        )
    return q, k, v, g, beta


@triton.jit
def _gather_states_kernel(
    state_ptr, slots_ptr, keep_ptr, out_ptr, SIZE, MASKED: tl.constexpr, BLOCK: tl.constexpr
):
    """out[n] = state[slots[n]] in fp32; zeros where ``keep[n]`` is False (``MASKED``)."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    slot = tl.load(slots_ptr + n).to(tl.int64)
    x = tl.load(state_ptr + slot * SIZE + offs, mask=mask, other=0.0).to(tl.float32)
    if MASKED:
        x = tl.where(tl.load(keep_ptr + n) != 0, x, 0.0)
    tl.store(out_ptr + n * SIZE + offs, x, mask=mask)


@triton.jit
def _store_states_kernel(
    final_ptr, chunk_states_ptr, slots_ptr, capture_chunks_ptr, capture_slots_ptr, state_ptr, N, SIZE,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Rows below N: chunk r's final state into state[slots[r]]; the others: capture c = r - N, the
    state at the start of fla-core chunk ``capture_chunks[c]`` into state[capture_slots[c]]."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    if r < N:
        src = final_ptr + r * SIZE
        slot = tl.load(slots_ptr + r).to(tl.int64)
    else:
        src = chunk_states_ptr + tl.load(capture_chunks_ptr + r - N).to(tl.int64) * SIZE
        slot = tl.load(capture_slots_ptr + r - N).to(tl.int64)
    x = tl.load(src + offs, mask=mask)
    tl.store(state_ptr + slot * SIZE + offs, x.to(state_ptr.dtype.element_ty), mask=mask)


_gather_states_launch = FastLaunch(_gather_states_kernel)
_store_states_launch = FastLaunch(_store_states_kernel)
_STATE_BLOCK = 4096  # state elements a program moves


def gather_initial_states(
    state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None
) -> torch.Tensor:
    """fla-core's initial states [n, ...] in fp32: each chunk's slot of ``state`` ([slots, Hv, dk,
    dv], contiguous), zeros for the chunks ``keep`` (bool [n], None: all kept) marks fresh. One
    launch for what index_select, a cast and a mask took three (and their gaps) per layer."""
    _check_recurrent_state(state, *state.shape[1:])
    size = state[0].numel()
    out = torch.empty((slots.shape[0], *state.shape[1:]), dtype=torch.float32, device=state.device)
    _gather_states_launch(
        (slots.shape[0], triton.cdiv(size, _STATE_BLOCK)),
        state, slots, slots if keep is None else keep, out, size, keep is not None, _STATE_BLOCK,
        num_warps=4,
    )  # fmt: skip
    return out


def store_final_states(
    state: torch.Tensor,
    slots: torch.Tensor,
    final: torch.Tensor,
    chunk_states: torch.Tensor,
    captures: StateCaptures | None,
) -> None:
    """The chunks' final states (fp32 [n, ...]) into their slots and the captures' states (taken
    from ``chunk_states``, fp32 [fla-core chunks, ...]) into theirs, in ``state``'s dtype: one launch
    for five (index_select, two casts, two index_copy)."""
    _check_recurrent_state(state, *state.shape[1:])
    size = state[0].numel()
    rows = slots.shape[0] + (0 if captures is None else captures.slots.shape[0])
    capture_chunks, capture_slots = (
        (slots, slots) if captures is None else (captures.gdn_chunks, captures.slots)
    )
    _store_states_launch(
        (rows, triton.cdiv(size, _STATE_BLOCK)),
        final, chunk_states, slots, capture_chunks, capture_slots, state, slots.shape[0], size, _STATE_BLOCK,
        num_warps=4,
    )  # fmt: skip


def _fla_chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial: torch.Tensor | None,
    varlen: Varlen,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla-core's ``chunk_gated_delta_rule`` forward after its l2norm and decay cumsum (the inputs
    come from ``gdn_chunk_inputs_triton``), step by step as its own forward runs them, without the
    autograd function around it, and keeping what that drops: the state at the start of every
    64-token chunk ([1, NT, Hv, dk, dv]), from which prefix-cache snapshots are taken mid-chunk at
    no extra pass. Inputs [1, T, heads, ...] as fla-core takes them."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra

    bounds = {
        "cu_seqlens": varlen.cu_seqlens_long,
        "chunk_indices": varlen.gdn_chunks,
        "chunk_size": GDN_CHUNK,
    }
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, **bounds)
    chunk_states, v_new, final = chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=g, initial_state=initial, output_final_state=True, **bounds
    )
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=chunk_states, g=g, scale=scale, **bounds)
    return o, final, chunk_states


def gdn_prefill_triton(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    key_heads: int,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    varlen: Varlen | None = None,
) -> torch.Tensor:
    """With fla-core and ``varlen``: the fused inputs kernel, then fla-core's chunked forward,
    taking ``varlen``'s state captures on the way; otherwise the unfused chain."""
    value_heads, key_dim, value_dim = state.shape[1:]
    if not fla_core_available() or varlen is None or not mixed.is_cuda:
        q, k, v = split_conv_output(mixed, key_heads, key_dim, value_heads)
        g, beta = gdn_gating_triton(a, b, A_log, dt_bias)
        args = (q, k, v, g, beta, state, state_slots, cu_seqlens, has_initial_state)
        if varlen is not None and varlen.captures is not None:
            # The recurrent kernel keeps no mid-chunk state: the reference takes the captures.
            return gated_delta_rule_prefill_ref(*args, varlen.captures)
        return gated_delta_rule_prefill_triton(*args)
    from fla.ops.utils.constant import RCP_LN2

    _check_recurrent_state(state, value_heads, key_dim, value_dim)
    inputs = gdn_chunk_inputs_triton(mixed, a, b, A_log, dt_bias, key_heads, key_dim, varlen, RCP_LN2)
    slots = state_slots.to(mixed.device)
    initial = None  # every chunk starts a prompt: fla-core starts from zeros without a gather
    if varlen.continues:  # the fresh chunks' slots may hold an old request's state: masked
        keep = None if varlen.continues_all else has_initial_state.to(device=mixed.device, dtype=torch.bool)
        initial = gather_initial_states(state, slots, keep)
    # fp32 operands: with bf16 ones fla's WY intermediates are bf16 and the final state drifts
    # ~2e-3 from the fp32 recurrence; in fp32 (tf32 products) it stays within 1e-3.
    o, final, chunk_states = _fla_chunk_forward(
        *(t.unsqueeze(0) for t in inputs), key_dim**-0.5, initial, varlen
    )
    store_final_states(state, slots, final, chunk_states[0], varlen.captures)
    return o.squeeze(0).to(mixed.dtype)
