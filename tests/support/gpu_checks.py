"""Shared by the GPU test modules: the relative error they bound, their random operands, and the
device parameter of a test that runs on the CPU and (marked ``cuda``) on the GPU."""

from __future__ import annotations

import pytest
import torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a non-finite output fails outright."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values on the GPU (scaled, then cast)."""
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)
