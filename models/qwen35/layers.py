"""The decoder layer and its parts (gated full attention, Gated DeltaNet, MLP) on one TP rank.

Weights are this rank's slices (see sharding.py), input projections fused by the loader. Each
row-parallel output projection is followed by an all-reduce. All math goes through kernels.ops;
the calls decode repeats every step go through ops bound to the layer's weights and states
(``kernels/bound.py``), which launch the same kernels with less host work per call.

Each decoder pre-norm's (1 + w) is folded into the columns of the one linear that reads its
output (``fold_norm_weight``): rmsnorm(h) * (1 + w) @ W.T equals rmsnorm(h) @ (W * (1 + w)).T, so
the pre-normed linears only scale by 1/rms and need not load and apply the weight
(docs/benchmarks/kernel-choices-h200.md).
The product is rounded to W's dtype once, where the unfolded model rounds the norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.kernels import ops
from phalanx.kernels.bound import (
    BoundDecodeAttention,
    BoundGdnDecodeStep,
    BoundNormRopeWriteKv,
    BoundPreNormedLinear,
)
from phalanx.kernels.varlen import Varlen
from phalanx.models.qwen35.config import FULL_ATTENTION, Qwen35Config
from phalanx.models.qwen35.parallel import RowParallelLinear, TensorParallel
from phalanx.models.qwen35.sharding import RankLayout

Weights = dict[str, torch.Tensor]


def fold_norm_weight(linear_weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """Multiplies column k of ``linear_weight`` [N, K] by 1 + ``norm_weight``[k], in place (the
    product computed in fp32, rounded once to the weight's dtype)."""
    if norm_weight.shape != (linear_weight.shape[1],):
        raise ValueError(
            f"norm weight {tuple(norm_weight.shape)} does not match the columns of linear weight "
            f"{tuple(linear_weight.shape)}"
        )
    linear_weight.mul_(1.0 + norm_weight.float())


@dataclass
class StepContext:
    """Per-step indexing shared by all layers. Prefill fields are None in decode and vice versa."""

    positions: torch.Tensor  # [T] int64
    kv_slot_ids: torch.Tensor  # [T] int64: page * page_size + offset of each token's K/V
    state_slots: torch.Tensor  # [n] int64 (prefill: per chunk; decode: per row)
    cu_seqlens: torch.Tensor | None = None  # prefill [n+1] int32
    starts: torch.Tensor | None = None  # prefill [n] int32
    page_tables: torch.Tensor | None = None  # prefill [n, P] / decode [B, P] int32
    has_initial_state: torch.Tensor | None = None  # prefill [n] bool
    seq_lens: torch.Tensor | None = None  # decode [B] int32
    varlen: Varlen | None = None  # prefill: the chunk bounds in every form the kernels read

    @property
    def is_prefill(self) -> bool:
        return self.cu_seqlens is not None


class FullAttention:
    """Gated softmax attention: per-head [q | gate] rows, (1+w) q/k norms, partial RoPE, paged KV."""

    def __init__(self, w: Weights, config: Qwen35Config, layout: RankLayout, tp: TensorParallel) -> None:
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.qkv_weight = w["qkv_proj.weight"]
        self.q_norm = w["q_norm.weight"]
        self.k_norm = w["k_norm.weight"]
        self.o_weight = w["o_proj.weight"]
        self.qkv = BoundPreNormedLinear(self.qkv_weight, self.eps)
        self.o_proj = RowParallelLinear(self.o_weight, tp)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.norm_rope_write_kv: BoundNormRopeWriteKv | None = None
        self.decode_attention: BoundDecodeAttention | None = None

    def allocate(self, num_pages: int, page_size: int, cos_sin: torch.Tensor) -> None:
        shape = (num_pages, page_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.o_weight.dtype, device=self.o_weight.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.norm_rope_write_kv = BoundNormRopeWriteKv(
            self.q_norm, self.k_norm, self.eps, cos_sin, self.k_cache, self.v_cache
        )
        self.decode_attention = BoundDecodeAttention(self.k_cache, self.v_cache, self.scale)

    def release(self) -> None:
        self.k_cache = self.v_cache = None
        self.norm_rope_write_kv = self.decode_attention = None

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual stream): x + residual is pre-normed inside the qkv linear (whose
        columns hold the norm's weight)."""
        tokens, hd = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * 2 * hd, self.num_kv_heads * hd
        qkv, residual = self.qkv(x, residual)
        q_gate, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * hd).split([hd, hd], dim=-1)
        # q/k norms, partial RoPE and the paged K/V write in one op (one kernel on CUDA).
        q = self.norm_rope_write_kv(
            q,
            k.view(tokens, self.num_kv_heads, hd),
            v.view(tokens, self.num_kv_heads, hd),
            ctx.positions,
            ctx.kv_slot_ids,
        )
        if ctx.is_prefill:
            attn = ops.paged_prefill_attention(
                q,
                self.k_cache,
                self.v_cache,
                ctx.page_tables,
                ctx.cu_seqlens,
                ctx.starts,
                self.scale,
                ctx.varlen,
            )
            gated = attn * torch.sigmoid(gate)
        else:  # the output gate is fused into decode attention
            gated = self.decode_attention(q, ctx.page_tables, ctx.seq_lens, gate)
        return self.o_proj(gated.reshape(tokens, -1)), residual


class GatedDeltaNet:
    """Linear attention: conv1d over q|k|v, L2-normed q/k, gated delta rule, gated norm, out_proj."""

    def __init__(self, w: Weights, config: Qwen35Config, layout: RankLayout, tp: TensorParallel) -> None:
        self.key_heads = layout.linear_key_heads
        self.value_heads = layout.linear_value_heads
        self.key_dim = config.linear_key_head_dim
        self.value_dim = config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        self.in_weight = w["in_proj.weight"]  # rows: q | k | v | z | b | a (local heads)
        self.conv_weight = w["conv1d.weight"].squeeze(1).contiguous()  # [conv_dim, K]
        self.dt_bias = w["dt_bias"]
        self.A_log = w["A_log"]  # float32
        self.norm = w["norm.weight"]  # float32
        self.out_weight = w["out_proj.weight"]
        self.in_proj = BoundPreNormedLinear(self.in_weight, self.eps)
        self.out_proj = RowParallelLinear(self.out_weight, tp)
        self.recurrent_state: torch.Tensor | None = None
        self.conv_state: torch.Tensor | None = None
        self.decode_step: BoundGdnDecodeStep | None = None

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(recurrent, conv) state shapes for ``num_slots`` slots (the model picks their dtypes)."""
        return (
            (num_slots, self.value_heads, self.key_dim, self.value_dim),
            (num_slots, self.conv_dim, self.kernel - 1),
        )

    def allocate(self, recurrent_state: torch.Tensor, conv_state: torch.Tensor) -> None:
        """Take this layer's state slots: views into the model's pools of every layer's states."""
        self.recurrent_state = recurrent_state
        self.conv_state = conv_state
        self.decode_step = BoundGdnDecodeStep(
            self.conv_weight,
            self.conv_state,
            self.A_log,
            self.dt_bias,
            self.norm,
            self.eps,
            self.recurrent_state,
        )

    def release(self) -> None:
        self.recurrent_state = self.conv_state = None
        self.decode_step = None

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual stream): x + residual is pre-normed inside in_proj (whose columns
        hold the norm's weight)."""
        tokens = x.shape[0]
        z_size = self.value_heads * self.value_dim
        projected, residual = self.in_proj(x, residual)
        qkv, z, b, a = projected.split([self.conv_dim, z_size, self.value_heads, self.value_heads], dim=-1)
        if not ctx.is_prefill:  # conv, gates, delta rule and gated norm in one op (one kernel on CUDA)
            z = z.view(tokens, self.value_heads, self.value_dim)
            y = self.decode_step(qkv, z, a, b, ctx.state_slots)
            return self.out_proj(y.reshape(tokens, -1)), residual
        mixed = ops.causal_conv1d_prefill(
            qkv,
            self.conv_weight,
            self.conv_state,
            ctx.state_slots,
            ctx.cu_seqlens,
            ctx.has_initial_state,
            ctx.varlen,
        )
        o = ops.gdn_prefill(
            mixed,
            a,
            b,
            self.A_log,
            self.dt_bias,
            self.key_heads,
            self.recurrent_state,
            ctx.state_slots,
            ctx.cu_seqlens,
            ctx.has_initial_state,
            ctx.varlen,
        )
        y = ops.gated_rms_norm(o, z.reshape(tokens, self.value_heads, self.value_dim), self.norm, self.eps)
        return self.out_proj(y.reshape(tokens, -1)), residual


class MLP:
    """SwiGLU: gate|up rows sharded, down columns sharded, then all-reduce."""

    def __init__(self, w: Weights, tp: TensorParallel, eps: float) -> None:
        self.gate_up_weight = w["gate_up_proj.weight"]
        self.down_weight = w["down_proj.weight"]
        self.gate_up = BoundPreNormedLinear(self.gate_up_weight, eps, silu_mul=True)
        self.down = RowParallelLinear(self.down_weight, tp)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual stream): x + residual is pre-normed inside gate_up (whose columns
        hold the norm's weight)."""
        hidden, residual = self.gate_up(x, residual)
        return self.down(hidden), residual


class DecoderLayer:
    """Pre-norm residual block: h += mixer(norm1(h)); h += mlp(norm2(h)). Each norm, with the
    residual add before it, runs inside the first linear that reads its output, and its (1 + w)
    is folded into that linear's columns here, in place: the layer consumes its weights."""

    def __init__(
        self, index: int, w: Weights, config: Qwen35Config, layout: RankLayout, tp: TensorParallel
    ) -> None:
        prefix = f"layers.{index}."
        own = {name[len(prefix) :]: t for name, t in w.items() if name.startswith(prefix)}
        self.is_full_attention = config.layer_types[index] == FULL_ATTENTION
        mixer_prefix = "self_attn." if self.is_full_attention else "linear_attn."
        mixer_w = {name[len(mixer_prefix) :]: t for name, t in own.items() if name.startswith(mixer_prefix)}
        self.attention = FullAttention(mixer_w, config, layout, tp) if self.is_full_attention else None
        self.linear_attention = None if self.is_full_attention else GatedDeltaNet(mixer_w, config, layout, tp)
        self.mlp = MLP(
            {name[4:]: t for name, t in own.items() if name.startswith("mlp.")}, tp, config.rms_norm_eps
        )
        mixer_in = self.attention.qkv_weight if self.attention else self.linear_attention.in_weight
        fold_norm_weight(mixer_in, own["input_layernorm.weight"])
        fold_norm_weight(self.mlp.gate_up_weight, own["post_attention_layernorm.weight"])

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.attention is not None:
            mixed, residual = self.attention(x, residual, ctx, cos_sin)
        else:
            mixed, residual = self.linear_attention(x, residual, ctx)
        return self.mlp(mixed, residual)
