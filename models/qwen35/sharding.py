"""Which slice of every checkpoint tensor one tensor-parallel rank keeps.

Full attention: q_proj by whole heads with their gates (each head's rows are ``[q | gate]``), k/v by
KV heads (or, with fewer KV heads than ranks, the one KV head this rank's query heads use), o_proj
by input columns. GDN: ``in_proj_qkv`` and ``conv1d`` by per-segment slices ``q_r | k_r | v_r``,
``in_proj_z/b/a``, ``dt_bias`` and ``A_log`` by value heads, the gated norm replicated, out_proj by
input columns. MLP gate/up by rows, down by columns. Embedding and lm_head by vocab rows.
Contiguous head blocks keep the GDN mapping ``key head = value head // (Hv / Hk)`` rank-local.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.models.qwen35.config import FULL_ATTENTION, Qwen35Config

Range = tuple[int, int]


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor as this rank reads it."""

    name: str  # without the checkpoint prefix, e.g. "layers.0.mlp.down_proj.weight"
    shape: tuple[int, ...]  # the full shape the checkpoint must hold
    dim: int = 0  # the dimension ``ranges`` index
    ranges: tuple[Range, ...] | None = None  # concatenated along ``dim``; None: the whole tensor
    keep_fp32: bool = False  # loaded as float32 whatever the model dtype
    fuse_into: str | None = None  # rows appended (in spec order) to this fused tensor instead

    @property
    def key(self) -> str:
        """The name the loaded tensor goes by: the fused tensor's, or the spec's own."""
        return self.fuse_into or self.name

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.ranges is None:
            return self.shape
        size = sum(hi - lo for lo, hi in self.ranges)
        return self.shape[: self.dim] + (size,) + self.shape[self.dim + 1 :]


@dataclass(frozen=True)
class RankLayout:
    """This rank's share of each sharded dimension (counts are local, starts are global indices)."""

    rank: int
    world_size: int
    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    linear_key_heads: int
    linear_key_head_start: int
    linear_value_heads: int
    linear_value_head_start: int
    intermediate: int
    intermediate_start: int
    vocab: int
    vocab_start: int

    @classmethod
    def build(cls, config: Qwen35Config, rank: int, world_size: int) -> RankLayout:
        config.validate_tp(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside TP degree {world_size}")
        heads = config.num_attention_heads // world_size
        kv = config.num_key_value_heads
        if kv >= world_size:
            kv_heads, kv_start = kv // world_size, rank * (kv // world_size)
        else:  # replicated: the ranks sharing one KV head form contiguous groups
            kv_heads, kv_start = 1, rank // (world_size // kv)
        key_heads = config.linear_num_key_heads // world_size
        value_heads = config.linear_num_value_heads // world_size
        inter = config.intermediate_size // world_size
        vocab = config.vocab_size // world_size
        return cls(
            rank=rank,
            world_size=world_size,
            num_heads=heads,
            head_start=rank * heads,
            num_kv_heads=kv_heads,
            kv_head_start=kv_start,
            linear_key_heads=key_heads,
            linear_key_head_start=rank * key_heads,
            linear_value_heads=value_heads,
            linear_value_head_start=rank * value_heads,
            intermediate=inter,
            intermediate_start=rank * inter,
            vocab=vocab,
            vocab_start=rank * vocab,
        )


def _block(start: int, count: int, width: int, offset: int = 0) -> Range:
    """Rows of ``count`` blocks of ``width`` starting at block ``start``, shifted by ``offset``."""
    return (offset + start * width, offset + (start + count) * width)


def tensor_specs(config: Qwen35Config, layout: RankLayout, *, include_lm_head: bool) -> list[TensorSpec]:
    """Every tensor this rank reads, in checkpoint order (embedding, layers, norm, head)."""
    c, r = config, layout
    hidden = c.hidden_size
    vocab_rows = (_block(r.vocab_start, r.vocab, 1),)
    specs = [TensorSpec("embed_tokens.weight", (c.vocab_size, hidden), 0, vocab_rows)]
    for i, kind in enumerate(c.layer_types):
        prefix = f"layers.{i}."
        specs += [
            TensorSpec(prefix + "input_layernorm.weight", (hidden,)),
            TensorSpec(prefix + "post_attention_layernorm.weight", (hidden,)),
        ]
        if kind == FULL_ATTENTION:
            specs += _full_attention_specs(prefix + "self_attn.", c, r)
        else:
            specs += _linear_attention_specs(prefix + "linear_attn.", c, r)
        specs += _mlp_specs(prefix + "mlp.", c, r)
    specs.append(TensorSpec("norm.weight", (hidden,)))
    if include_lm_head:
        specs.append(TensorSpec("lm_head.weight", (c.vocab_size, hidden), 0, vocab_rows))
    return specs


def _full_attention_specs(prefix: str, c: Qwen35Config, r: RankLayout) -> list[TensorSpec]:
    hidden, hd = c.hidden_size, c.head_dim
    q_rows = (_block(r.head_start, r.num_heads, 2 * hd),)  # whole heads with their gates
    kv_rows = (_block(r.kv_head_start, r.num_kv_heads, hd),)
    kv_shape = (c.num_key_value_heads * hd, hidden)
    qkv = prefix + "qkv_proj.weight"  # local rows: [q|gate] heads, then k, then v
    return [
        TensorSpec(
            prefix + "q_proj.weight", (c.num_attention_heads * 2 * hd, hidden), 0, q_rows, fuse_into=qkv
        ),
        TensorSpec(prefix + "k_proj.weight", kv_shape, 0, kv_rows, fuse_into=qkv),
        TensorSpec(prefix + "v_proj.weight", kv_shape, 0, kv_rows, fuse_into=qkv),
        TensorSpec(prefix + "q_norm.weight", (hd,)),
        TensorSpec(prefix + "k_norm.weight", (hd,)),
        TensorSpec(
            prefix + "o_proj.weight",
            (hidden, c.num_attention_heads * hd),
            1,
            (_block(r.head_start, r.num_heads, hd),),
        ),
    ]


def _linear_attention_specs(prefix: str, c: Qwen35Config, r: RankLayout) -> list[TensorSpec]:
    hidden, dk, dv = c.hidden_size, c.linear_key_head_dim, c.linear_value_head_dim
    hv = c.linear_num_value_heads
    key_dim = c.linear_key_dim
    # in_proj_qkv rows and conv1d channels: q heads, k heads, v heads, each sliced on its own.
    qkv_rows = (
        _block(r.linear_key_head_start, r.linear_key_heads, dk),
        _block(r.linear_key_head_start, r.linear_key_heads, dk, offset=key_dim),
        _block(r.linear_value_head_start, r.linear_value_heads, dv, offset=2 * key_dim),
    )
    value_rows = (_block(r.linear_value_head_start, r.linear_value_heads, dv),)
    value_heads = (_block(r.linear_value_head_start, r.linear_value_heads, 1),)
    in_proj = prefix + "in_proj.weight"  # local rows: q_r, k_r, v_r, z_r, b_r, a_r
    return [
        TensorSpec(
            prefix + "in_proj_qkv.weight", (c.linear_conv_dim, hidden), 0, qkv_rows, fuse_into=in_proj
        ),
        TensorSpec(
            prefix + "in_proj_z.weight", (c.linear_value_dim, hidden), 0, value_rows, fuse_into=in_proj
        ),
        TensorSpec(prefix + "in_proj_b.weight", (hv, hidden), 0, value_heads, fuse_into=in_proj),
        TensorSpec(prefix + "in_proj_a.weight", (hv, hidden), 0, value_heads, fuse_into=in_proj),
        TensorSpec(prefix + "conv1d.weight", (c.linear_conv_dim, 1, c.linear_conv_kernel_dim), 0, qkv_rows),
        TensorSpec(prefix + "dt_bias", (hv,), 0, value_heads),
        TensorSpec(prefix + "A_log", (hv,), 0, value_heads, keep_fp32=True),
        TensorSpec(prefix + "norm.weight", (dv,), keep_fp32=True),
        TensorSpec(prefix + "out_proj.weight", (hidden, c.linear_value_dim), 1, value_rows),
    ]


def _mlp_specs(prefix: str, c: Qwen35Config, r: RankLayout) -> list[TensorSpec]:
    hidden, inter = c.hidden_size, c.intermediate_size
    rows = (_block(r.intermediate_start, r.intermediate, 1),)
    gate_up = prefix + "gate_up_proj.weight"
    return [
        TensorSpec(prefix + "gate_proj.weight", (inter, hidden), 0, rows, fuse_into=gate_up),
        TensorSpec(prefix + "up_proj.weight", (inter, hidden), 0, rows, fuse_into=gate_up),
        TensorSpec(prefix + "down_proj.weight", (hidden, inter), 1, rows),
    ]
