"""Partial NeoX-style rotary embedding (only the first rotary_dim dims of each head rotate)."""

from __future__ import annotations

import torch


def rope_cache(max_pos: int, rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """cos_sin [max_pos, rotary_dim] fp32: the first half holds cos, the second sin, per frequency."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(max_pos, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotate_half over x[..., :rotary_dim], the rest passes through."""
    rotary_dim = cos_sin.shape[-1]
    half = rotary_dim // 2
    cs = cos_sin[positions].unsqueeze(1)  # [T, 1, rd]
    cos, sin = cs[..., :half], cs[..., half:]
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
