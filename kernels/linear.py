"""Linear-layer references: ``y = x @ w.T`` and the MLP's gate_up projection fused with SiLU-and-mul.

Weights are row-major ``[N, K]`` (torch's ``F.linear`` layout). The fused op takes the MLP's
``gate_up`` weight ``[2I, K]`` (gate rows first, then up rows) and returns ``silu(gate) * up``
``[M, I]``; it is exactly ``silu_and_mul(linear(x, w_gate_up))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in x.dtype."""
    return F.linear(x, w)


def linear_silu_and_mul_ref(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """x [M, K], w_gate_up [2I, K] -> silu(x @ w_gate[:I].T) * (x @ w_gate_up[I:].T), [M, I]."""
    return silu_and_mul_ref(F.linear(x, w_gate_up))
