"""RMSNorm references: Qwen's zero-centred (1 + w) norm and the GDN output's gated norm (plain w)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = rmsnorm(h) * (1 + w) in fp32, h = x + residual (or x); returns (y in x.dtype, h).
    ``weight`` None: no (1 + w) factor (the model folds it into the linear that reads y)."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (1.0 + weight.float())
    return y.to(x.dtype), h


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * rmsnorm(x) * silu(z), normalised over the last dim (dv), fp32 math."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float() * F.silu(z.float())).to(x.dtype)
