"""The Qwen3.5 family's text geometries (``shared/reference/qwen35-model.md``), and random tensors
for them: what the benchmarks, ``make-random-model`` and the GPU tests build models from."""

from __future__ import annotations

import torch

from phalanx.models.tiny import TINY_GEOMETRY

# What every released size shares (shared/reference/qwen35-model.md); each size adds its own widths.
_FAMILY: dict[str, object] = dict(
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    vocab_size=248320,
)
_SMALL = dict(_FAMILY, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2)
_MID = dict(_FAMILY, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4)

GEOMETRIES: dict[str, dict[str, object]] = {
    "tiny": dict(TINY_GEOMETRY, tie_word_embeddings=False),
    "0.8b": dict(
        _SMALL, hidden_size=1024, intermediate_size=3584, linear_num_value_heads=16, tie_word_embeddings=True
    ),
    "2b": dict(
        _SMALL, hidden_size=2048, intermediate_size=6144, linear_num_value_heads=16, tie_word_embeddings=True
    ),
    "4b": dict(
        _MID, hidden_size=2560, intermediate_size=9216, linear_num_value_heads=32, tie_word_embeddings=True
    ),
    "9b": dict(
        _MID, hidden_size=4096, intermediate_size=12288, linear_num_value_heads=32, tie_word_embeddings=False
    ),
    "27b": dict(
        _MID,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        linear_num_value_heads=48,
        tie_word_embeddings=False,
    ),
}
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}


def config_dict(geometry: str) -> dict[str, object]:
    raw = dict(GEOMETRIES[geometry])
    raw.update(
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        rope_parameters=dict(ROPE),
        eos_token_id=[0],
    )
    return raw


def random_tensor(spec, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One checkpoint tensor, random but shaped like a trained one where a convention matters
    (decays, norm weights, conv taps)."""
    shape, name = spec.local_shape, spec.name
    t_dtype = torch.float32 if spec.keep_fp32 else dtype
    if name.endswith("A_log"):
        t = torch.rand(shape, generator=gen, device=device).mul(15).add(1).log()
    elif name.endswith("linear_attn.norm.weight"):
        t = torch.rand(shape, generator=gen, device=device).add(0.5)
    elif name.endswith("dt_bias") or name.endswith("norm.weight"):
        t = torch.randn(shape, generator=gen, device=device).mul(0.1)
    elif name.endswith("conv1d.weight"):
        t = torch.randn(shape, generator=gen, device=device).mul(0.3)
    else:
        t = torch.randn(shape, generator=gen, device=device, dtype=t_dtype).mul(0.02)
    return t.to(t_dtype)
