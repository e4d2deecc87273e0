"""The whole Gated DeltaNet decode step as one op (torch reference).

``gdn_decode_step`` = causal conv1d decode (+ SiLU) over the qkv channels, split into q / k / v,
gates, the gated delta rule step, and the gated RMSNorm of its output: the chain of
``kernels/conv1d.py``, ``kernels/gdn.py`` and ``kernels/norms.py`` ops between the GDN input
projections and ``out_proj``. On CUDA ``gdn_step_triton.py`` runs it as the conv kernel and one
more (or one, ``PHALANX_GDN=fused``), which matters at decode, where each launch costs more than
the work it does.

Shapes (local heads): mixed_qkv [B, 2*Hk*dk + Hv*dv] (pre-conv ``in_proj_qkv`` output),
conv_weight [conv_dim, K], z [B, Hv, dv], a / b [B, Hv], A_log / dt_bias [Hv], norm_weight [dv],
conv_state [slots, conv_dim, K-1], state [slots, Hv, dk, dv] fp32 or bf16 (computed in fp32),
state_slots [B] int64.
Returns y [B, Hv, dv] in mixed_qkv's dtype; both states are updated in place.
"""

from __future__ import annotations

import torch

from phalanx.kernels.conv1d import causal_conv1d_decode_ref
from phalanx.kernels.gdn import gated_delta_rule_decode_ref, gdn_gating_ref
from phalanx.kernels.norms import gated_rms_norm_ref


def gdn_split_sizes(conv_dim: int, state: torch.Tensor) -> tuple[int, int, int, int]:
    """(Hk, dk, Hv, dv) from the conv channel count and the recurrent state's shape."""
    _, hv, dk, dv = state.shape
    key_dim = (conv_dim - hv * dv) // 2
    if key_dim <= 0 or key_dim % dk != 0 or 2 * key_dim + hv * dv != conv_dim:
        raise ValueError(f"conv_dim {conv_dim} does not split into q/k of head size {dk} and v of {hv}x{dv}")
    return key_dim // dk, dk, hv, dv


def gdn_decode_step_ref(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    batch, conv_dim = mixed_qkv.shape
    hk, dk, hv, dv = gdn_split_sizes(conv_dim, state)
    mixed = causal_conv1d_decode_ref(mixed_qkv, conv_weight, conv_state, state_slots)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    o = gated_delta_rule_decode_ref(
        q.reshape(batch, hk, dk),
        k.reshape(batch, hk, dk),
        v.reshape(batch, hv, dv),
        g,
        beta,
        state,
        state_slots,
    )
    return gated_rms_norm_ref(o, z, norm_weight, eps)
