"""The ops the model calls: CPU tensors run the torch references, CUDA tensors the Triton versions.

Triton modules are imported inside each function, only when a CUDA tensor arrives, so the CPU path
never imports CUDA-only code. Signatures and semantics are the contract in each reference's module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from phalanx.config import settings
from phalanx.kernels.activation import silu_and_mul_ref
from phalanx.kernels.attention import paged_decode_attention_ref, paged_prefill_attention_ref
from phalanx.kernels.conv1d import capture_conv_states, causal_conv1d_decode_ref, causal_conv1d_prefill_ref
from phalanx.kernels.embedding import embedding_ref
from phalanx.kernels.gdn import (
    gated_delta_rule_decode_ref,
    gated_delta_rule_prefill_ref,
    gdn_gating_ref,
    gdn_prefill_ref,
)
from phalanx.kernels.gdn_step import gdn_decode_step_ref
from phalanx.kernels.greedy import greedy_pick_ref
from phalanx.kernels.kv_cache import decode_kv_indices_ref, write_kv_ref
from phalanx.kernels.linear import (
    check_out,
    linear_fp32_ref,
    linear_ref,
    linear_silu_and_mul_ref,
    rms_norm_linear_ref,
    rms_norm_linear_silu_and_mul_ref,
)
from phalanx.kernels.norms import gated_rms_norm_ref, rms_norm_ref
from phalanx.kernels.rope import apply_rope_ref, rope_cache
from phalanx.kernels.rope_kv import norm_rope_write_kv_ref
from phalanx.kernels.varlen import Varlen

__all__ = [
    "apply_rope",
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "decode_kv_indices",
    "embedding",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "gated_rms_norm",
    "norm_rope_write_kv",
    "gdn_decode_step",
    "gdn_gating",
    "gdn_prefill",
    "greedy_pick",
    "linear",
    "linear_fp32",
    "linear_silu_and_mul",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rms_norm_linear",
    "rms_norm_linear_silu_and_mul",
    "rope_cache",
    "silu_and_mul",
    "write_kv",
]

_triton_cache: dict[str, Callable[..., Any]] = {}

# Linears on CUDA: the Triton skinny GEMV/GEMM up to this many rows, cuBLAS (F.linear) above, where
# the batch is wide enough for cuBLAS's tiles. PHALANX_LINEAR=cublas|triton|auto (read once, here)
# forces one side for A/B runs; "triton" uses Triton at every M.
LINEAR_TRITON_MAX_M = 64
LINEAR_BACKEND = settings.linear_backend()
_TRITON_LINEAR_DTYPES = (torch.bfloat16, torch.float16)


def _triton(module: str, name: str) -> Callable[..., Any]:
    key = f"{module}.{name}"
    fn = _triton_cache.get(key)
    if fn is None:
        fn = getattr(importlib.import_module(f"phalanx.kernels.{module}_triton"), f"{name}_triton")
        _triton_cache[key] = fn
    return fn


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        return _triton("norms", "rms_norm")(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return _triton("norms", "gated_rms_norm")(x, z, weight, eps)
    return gated_rms_norm_ref(x, z, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return _triton("activation", "silu_and_mul")(x)
    return silu_and_mul_ref(x)


def triton_linear_rows(rows: int) -> bool:
    """Whether a linear over ``rows`` rows is Triton's (dtype and layout allowing), else cuBLAS's;
    a bound linear (``kernels/linear_bind_triton.py``) follows the same rule."""
    return LINEAR_BACKEND == "triton" or (LINEAR_BACKEND != "cublas" and rows <= LINEAR_TRITON_MAX_M)


def _triton_linear(x: torch.Tensor, w: torch.Tensor) -> bool:
    if x.dtype not in _TRITON_LINEAR_DTYPES or w.stride(-1) != 1:
        return False
    return triton_linear_rows(x.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T; with ``out`` ([M, N], contiguous, x's dtype) written there instead of a new tensor
    (a row-parallel linear writes straight into the all-reduce's buffer)."""
    if x.is_cuda and _triton_linear(x, w):
        return _triton("linear", "linear")(x, w, out)  # checks out itself
    if out is not None:
        check_out(out, x, w)
    if not x.is_cuda:
        return linear_ref(x, w) if out is None else out.copy_(linear_ref(x, w))
    return F.linear(x, w) if out is None else torch.mm(x, w.t(), out=out)


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T as float32 (the vocab head's logits): the fp32 sums are kept, not rounded to x's
    dtype and widened again by a kernel of its own (docs/benchmarks/kernel-choices-h200.md)."""
    if x.is_cuda and _triton_linear(x, w):
        return _triton("linear", "linear_fp32")(x, w)
    if x.is_cuda and x.dtype in _TRITON_LINEAR_DTYPES:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return linear_fp32_ref(x, w)


def greedy_pick(
    logits: torch.Tensor,
    slots: torch.Tensor,
    fed: torch.Tensor,
    landing: torch.Tensor | None = None,
    seq: torch.Tensor | None = None,
) -> torch.Tensor:
    if logits.is_cuda:
        return _triton("greedy", "greedy_pick")(logits, slots, fed, landing, seq)
    return greedy_pick_ref(logits, slots, fed, landing, seq)


def linear_silu_and_mul(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:
        return linear_silu_and_mul_ref(x, w_gate_up)
    if _triton_linear(x, w_gate_up):
        return _triton("linear", "linear_silu_and_mul")(x, w_gate_up)
    return silu_and_mul(F.linear(x, w_gate_up))


def rms_norm_linear(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_then_linear(x, weight, eps, residual, w, silu_mul=False)


def rms_norm_linear_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    w_gate_up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_then_linear(x, weight, eps, residual, w_gate_up, silu_mul=True)


def _norm_then_linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    silu_mul: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    name = "rms_norm_linear_silu_and_mul" if silu_mul else "rms_norm_linear"
    if not x.is_cuda:
        ref = rms_norm_linear_silu_and_mul_ref if silu_mul else rms_norm_linear_ref
        return ref(x, weight, eps, residual, w)
    if _triton_linear(x, w):
        return _triton("linear", name)(x, weight, eps, residual, w)
    normed, h = rms_norm(x, weight, eps, residual)  # then cuBLAS: these rows are not Triton's
    return (linear_silu_and_mul if silu_mul else linear)(normed, w), h


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return _triton("rope", "apply_rope")(x, positions, cos_sin)
    return apply_rope_ref(x, positions, cos_sin)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor
) -> None:
    if k.is_cuda:
        _triton("kv_cache", "write_kv")(k, v, k_cache, v_cache, slot_ids)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_ids)


def embedding(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int = 0) -> torch.Tensor:
    if weight.is_cuda:
        return _triton("embedding", "embedding")(tokens, weight, vocab_start)
    return embedding_ref(tokens, weight, vocab_start)


def decode_kv_indices(
    positions: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if positions.is_cuda:
        return _triton("kv_cache", "decode_kv_indices")(positions, page_table, page_size)
    return decode_kv_indices_ref(positions, page_table, page_size)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    if q.is_cuda:
        return _triton("attention", "paged_decode_attention")(
            q, k_cache, v_cache, page_table, seq_lens, scale, gate
        )
    return paged_decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, scale, gate)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    varlen: Varlen | None = None,
) -> torch.Tensor:
    """``varlen`` (the same bounds, worked out on the host) spares the CUDA path a host sync."""
    if q.is_cuda:
        return _triton("attention_prefill", "paged_prefill_attention")(
            q, k_cache, v_cache, page_tables, cu_seqlens, starts, scale, varlen
        )
    return paged_prefill_attention_ref(q, k_cache, v_cache, page_tables, cu_seqlens, starts, scale)


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    if x.is_cuda:
        return _triton("conv1d", "causal_conv1d_decode")(x, weight, conv_state, state_slots)
    return causal_conv1d_decode_ref(x, weight, conv_state, state_slots)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    varlen: Varlen | None = None,
) -> torch.Tensor:
    """``varlen``'s state captures (if any) are taken from ``x`` too."""
    if x.is_cuda:
        return _triton("conv1d", "causal_conv1d_prefill")(
            x, weight, conv_state, state_slots, cu_seqlens, has_initial_state, varlen
        )
    if varlen is not None and varlen.captures is not None:
        capture_conv_states(x, conv_state, varlen.captures)
    return causal_conv1d_prefill_ref(x, weight, conv_state, state_slots, cu_seqlens, has_initial_state)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if a.is_cuda:
        return _triton("gdn", "gdn_gating")(a, b, A_log, dt_bias)
    return gdn_gating_ref(a, b, A_log, dt_bias)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    if q.is_cuda:
        return _triton("gdn", "gated_delta_rule_decode")(q, k, v, g, beta, state, state_slots)
    return gated_delta_rule_decode_ref(q, k, v, g, beta, state, state_slots)


def gated_delta_rule_prefill(
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
    args = (q, k, v, g, beta, state, state_slots, cu_seqlens, has_initial_state)
    if q.is_cuda:
        return _triton("gdn", "gated_delta_rule_prefill")(*args)
    return gated_delta_rule_prefill_ref(*args)


# Fused ops: each is the chain of the ops above that it replaces (see its reference module); on
# CUDA one kernel instead of several launches.


def norm_rope_write_kv(
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
    args = (q, k, v, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, slot_ids)
    if q.is_cuda:
        return _triton("rope_kv", "norm_rope_write_kv")(*args)
    return norm_rope_write_kv_ref(*args)


def gdn_prefill(
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
    """``varlen``'s state captures (if any) are taken on the way."""
    args = (mixed, a, b, A_log, dt_bias, key_heads, state, state_slots, cu_seqlens, has_initial_state)
    if mixed.is_cuda:
        return _triton("gdn_prefill", "gdn_prefill")(*args, varlen)
    return gdn_prefill_ref(*args, None if varlen is None else varlen.captures)


def gdn_decode_step(
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
    args = (mixed_qkv, conv_weight, conv_state, z, a, b, A_log, dt_bias, norm_weight, eps, state, state_slots)
    if mixed_qkv.is_cuda:
        return _triton("gdn_step", "gdn_decode_step")(*args)
    return gdn_decode_step_ref(*args)
