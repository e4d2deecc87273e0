"""Ops bound to one layer's weights and states, for the calls that decode repeats every step.

An eager decode step is host time: at batch 1 the GPU finishes each kernel before Python has
launched the next. Each general op (``kernels/ops.py``) checks its inputs, derives its launch from
their shapes and strides and looks its kernel up on every call, although a layer's calls differ
from one step to the next only in the activations they take. A bound op does that work once per
input layout: its first two calls of a layout take the general path (the first compiles, tunes
and races cuBLAS), after which it binds the launch (the Triton modules' ``bind_*``, through
``FastLaunch.bind``: every argument but the per-call tensors fixed) and later calls only allocate
their outputs and launch; a linear whose key cuBLAS answers calls the mm itself
(``kernels/linear_bind_triton.py``). The kernels and their arguments are the general path's, so
the results are the same bit for bit.

On CPU tensors a bound op is the general op. So is it for a layout it has no binding for (an input
the general path would copy first, more than ``MAX_BOUND_ROWS`` rows, as in prefill). It binds
outside CUDA-graph capture only: a capture records kernels without running them, so a tensor made
there holds nothing until the graph replays. Weights and states are bound as
they are at binding: the layers make new bound ops when they allocate their caches.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from phalanx.kernels import ops

# Rows up to which a layout is bound: decode batches. Prefill's token counts vary from call to
# call; each would be a binding of its own.
MAX_BOUND_ROWS = 256


class _Bindings:
    """Per input layout: the bound launch (None where the layout has none), made at its second call."""

    def __init__(self) -> None:
        self._bound: dict[Hashable, Callable[..., Any] | None] = {}
        self._seen: set[Hashable] = set()

    def get(self, key: Hashable) -> Callable[..., Any] | None:
        return self._bound.get(key)

    def after_general_call(
        self, key: Hashable, rows: int, bind: Callable[[], Callable[..., Any] | None]
    ) -> None:
        """Called after each general call of ``key``'s layout: binds at the second."""
        if key in self._bound or rows > MAX_BOUND_ROWS:
            return
        if key not in self._seen:
            self._seen.add(key)
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self._bound[key] = bind()


def _bind_linear(*args: Any, **kwargs: Any) -> Callable[..., Any] | None:
    from phalanx.kernels.linear_bind_triton import bind_linear

    return bind_linear(*args, **kwargs)


class BoundLinear:
    """x @ w.T for one weight (``ops.linear``; ``ops.linear_fp32`` with ``fp32_out``)."""

    def __init__(self, weight: torch.Tensor, fp32_out: bool = False) -> None:
        self.weight = weight
        self.fp32_out = fp32_out
        self.op = "linear_fp32" if fp32_out else "linear"
        self._bindings = _Bindings()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return ops.linear_fp32(x, self.weight) if self.fp32_out else ops.linear(x, self.weight)
        key = (x.shape, x.stride(), x.dtype)
        bound = self._bindings.get(key)
        if bound is not None:
            return bound(x, None)[0]
        y = ops.linear_fp32(x, self.weight) if self.fp32_out else ops.linear(x, self.weight)
        out_dtype = torch.float32 if self.fp32_out else None
        self._bindings.after_general_call(
            key, x.shape[0], lambda: _bind_linear(x, self.weight, out_dtype=out_dtype)
        )
        return y


class BoundPreNormedLinear:
    """(1 + w) RMSNorm of x + residual, then @ weight.T (``ops.rms_norm_linear``; with
    ``silu_mul``, ``ops.rms_norm_linear_silu_and_mul``): (y, the residual stream x + residual).
    The norm's weight is folded into ``weight``'s columns (``models/qwen35/layers.py``)."""

    def __init__(self, weight: torch.Tensor, eps: float, silu_mul: bool = False) -> None:
        self.weight = weight
        self.eps = eps
        self.silu_mul = silu_mul
        self.op = "rms_norm_linear_silu_and_mul" if silu_mul else "rms_norm_linear"
        self._general = getattr(ops, self.op)
        self._bindings = _Bindings()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_cuda:
            return self._general(x, None, self.eps, residual, self.weight)
        key = (
            x.shape,
            x.stride(),
            x.dtype,
            None if residual is None else (residual.stride(), residual.dtype),
        )
        bound = self._bindings.get(key)
        if bound is not None:
            return bound(x, residual)
        y, h = self._general(x, None, self.eps, residual, self.weight)
        self._bindings.after_general_call(
            key,
            x.shape[0],
            lambda: _bind_linear(x, self.weight, self.silu_mul, norm=(None, self.eps, residual)),
        )
        return y, h


class BoundGdnDecodeStep:
    """``ops.gdn_decode_step`` for one Gated DeltaNet layer: its conv weight, gates, norm and
    states fixed; per call the input projection's qkv, z, a, b and the rows' state slots."""

    op = "gdn_decode_step"

    def __init__(
        self,
        conv_weight: torch.Tensor,
        conv_state: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        recurrent_state: torch.Tensor,
    ) -> None:
        self.conv_weight, self.conv_state, self.recurrent_state = conv_weight, conv_state, recurrent_state
        self.A_log, self.dt_bias, self.norm_weight, self.eps = A_log, dt_bias, norm_weight, eps
        self._bindings = _Bindings()

    def __call__(
        self, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state_slots: torch.Tensor
    ) -> torch.Tensor:
        key = (
            (qkv.shape, qkv.stride(), z.shape, z.stride(), a.stride(), b.stride(), qkv.dtype)
            if qkv.is_cuda
            else None
        )
        bound = self._bindings.get(key)
        if bound is not None:
            return bound(qkv, z, a, b, state_slots)
        args = self._arguments(qkv, z, a, b, state_slots)
        y = ops.gdn_decode_step(*args)
        if key is not None:
            self._bindings.after_general_call(key, qkv.shape[0], lambda: _bind_gdn_decode_step(*args))
        return y

    def _arguments(
        self, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state_slots: torch.Tensor
    ) -> tuple[object, ...]:
        """The arguments of ``ops.gdn_decode_step`` (and of its binding), in its order."""
        return (
            qkv,
            self.conv_weight,
            self.conv_state,
            z,
            a,
            b,
            self.A_log,
            self.dt_bias,
            self.norm_weight,
            self.eps,
            self.recurrent_state,
            state_slots,
        )


def _bind_gdn_decode_step(*args: object) -> Callable[..., torch.Tensor] | None:
    from phalanx.kernels.gdn_step_triton import bind_gdn_decode_step

    return bind_gdn_decode_step(*args)


class BoundDecodeAttention:
    """``ops.paged_decode_attention`` over one layer's KV caches: per call q, the page table, the
    sequence lengths and the output gate."""

    op = "paged_decode_attention"

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        self.k_cache, self.v_cache, self.scale = k_cache, v_cache, scale
        self._bindings = _Bindings()

    def __call__(
        self, q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, gate: torch.Tensor | None
    ) -> torch.Tensor:
        if not q.is_cuda:
            return ops.paged_decode_attention(
                q, self.k_cache, self.v_cache, page_table, seq_lens, self.scale, gate
            )
        key = (
            q.shape,
            q.stride(),
            page_table.shape,
            page_table.stride(),
            None if gate is None else gate.stride(),
        )
        bound = self._bindings.get(key)
        if bound is not None:
            return bound(q, page_table, seq_lens, gate)
        out = ops.paged_decode_attention(
            q, self.k_cache, self.v_cache, page_table, seq_lens, self.scale, gate
        )

        def bind() -> Callable[..., torch.Tensor] | None:
            from phalanx.kernels.attention_triton import bind_paged_decode_attention

            return bind_paged_decode_attention(
                q, self.k_cache, self.v_cache, page_table, seq_lens, self.scale, gate
            )

        self._bindings.after_general_call(key, q.shape[0], bind)
        return out


class BoundNormRopeWriteKv:
    """``ops.norm_rope_write_kv`` for one attention layer: its q/k norms, the RoPE table and its
    KV caches fixed; per call q, k, v, the positions and the KV slots."""

    op = "norm_rope_write_kv"

    def __init__(
        self,
        q_norm: torch.Tensor,
        k_norm: torch.Tensor,
        eps: float,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        self.q_norm, self.k_norm, self.eps, self.cos_sin = q_norm, k_norm, eps, cos_sin
        self.k_cache, self.v_cache = k_cache, v_cache
        self._bindings = _Bindings()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> torch.Tensor:
        key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype) if q.is_cuda else None
        bound = self._bindings.get(key)
        if bound is not None:
            return bound(q, k, v, positions, slot_ids)
        general = (self.q_norm, self.k_norm, self.eps, positions, self.cos_sin, self.k_cache, self.v_cache)
        out = ops.norm_rope_write_kv(q, k, v, *general, slot_ids)
        if key is None:
            return out

        def bind() -> Callable[..., torch.Tensor] | None:
            from phalanx.kernels.rope_kv_triton import bind_norm_rope_write_kv

            return bind_norm_rope_write_kv(q, k, v, *general, slot_ids)

        self._bindings.after_general_call(key, q.shape[0], bind)
        return out


# Every bound op, each with ``op``: the name of the ``kernels.ops`` function it stands for.
BOUND_OPS = (
    BoundLinear,
    BoundPreNormedLinear,
    BoundGdnDecodeStep,
    BoundDecodeAttention,
    BoundNormRopeWriteKv,
)
