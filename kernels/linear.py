"""Linear-layer references: ``y = x @ w.T`` and the MLP's gate_up projection fused with SiLU-and-mul.

Weights are row-major ``[N, K]`` (torch's ``F.linear`` layout). The fused op takes the MLP's
``gate_up`` weight ``[2I, K]`` (gate rows first, then up rows) and returns ``silu(gate) * up``
``[M, I]``; it is exactly ``silu_and_mul(linear(x, w_gate_up))``.

The ``rms_norm_*`` forms apply the decoder's pre-norm first (``kernels/norms.py``'s ``rms_norm``,
residual add included) and also return the residual stream it leaves; on CUDA the norm runs in the
linear kernel's prologue, which saves a launch and a round trip per norm. Their norm ``weight`` may
be None: the model folds each pre-norm's (1 + w) into the columns of the linear that reads it
(``models/qwen35/layers.py``), so the norm only scales by 1/rms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.kernels.activation import silu_and_mul_ref
from phalanx.kernels.norms import rms_norm_ref


def check_out(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """A linear's ``out`` buffer must be exactly the [M, N] result it receives."""
    shape = (x.shape[0], w.shape[0])
    if out.shape != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"linear: out {tuple(out.shape)} {out.dtype} on {out.device} is not a contiguous "
            f"{shape} {x.dtype} on {x.device}"
        )


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in x.dtype."""
    return F.linear(x, w)


def linear_fp32_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in float32, from float32 operands (CPU torch has no bf16 matmul
    with a float32 result; an fp32 model passes through without a copy)."""
    return F.linear(x.float(), w.float())


def linear_silu_and_mul_ref(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """x [M, K], w_gate_up [2I, K] -> silu(x @ w_gate[:I].T) * (x @ w_gate_up[I:].T), [M, I]."""
    return silu_and_mul_ref(F.linear(x, w_gate_up))


def rms_norm_linear_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(h), w), h) with h = x + residual (or x): the norm's output in x.dtype."""
    normed, h = rms_norm_ref(x, weight, eps, residual)
    return linear_ref(normed, w), h


def rms_norm_linear_silu_and_mul_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    w_gate_up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear_silu_and_mul(rms_norm(h), w_gate_up), h) with h = x + residual (or x)."""
    normed, h = rms_norm_ref(x, weight, eps, residual)
    return linear_silu_and_mul_ref(normed, w_gate_up), h
