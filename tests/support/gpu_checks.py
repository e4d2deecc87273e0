"""Shared by the GPU test modules: the relative error they bound and their random operands."""

from __future__ import annotations

import torch


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a non-finite output fails outright."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values on the GPU (scaled, then cast)."""
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)
