"""Causal depthwise conv1d + SiLU references with a per-slot state of the last K-1 raw inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.kernels.varlen import StateCaptures


def causal_conv1d_decode_ref(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    """x [B, C]; conv over (state ++ x) per channel, SiLU; the state shifts by one in place."""
    history = conv_state[state_slots]  # [B, C, K-1]
    window = torch.cat([history, x.unsqueeze(-1).to(history.dtype)], dim=-1)  # [B, C, K]
    out = F.silu((window.float() * weight.float()).sum(-1))
    conv_state.index_copy_(0, state_slots, window[..., 1:])
    return out.to(x.dtype)


def causal_conv1d_prefill_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """x [T, C] holding n chunks; each chunk continues its slot's state (or zeros) and writes it back."""
    channels, kernel = weight.shape
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for i, (slot, has_state) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist(), strict=True)):
        lo, hi = bounds[i], bounds[i + 1]
        if has_state:
            history = conv_state[slot]
        else:
            history = torch.zeros(channels, kernel - 1, dtype=conv_state.dtype, device=x.device)
        inputs = torch.cat([history, x[lo:hi].t().to(history.dtype)], dim=-1)  # [C, K-1+L]
        conv = F.conv1d(inputs.float().unsqueeze(0), weight.float().unsqueeze(1), groups=channels)
        out[lo:hi] = F.silu(conv[0]).t().to(x.dtype)
        conv_state[slot] = inputs[:, inputs.shape[1] - (kernel - 1) :]
    return out


def capture_conv_states(x: torch.Tensor, conv_state: torch.Tensor, captures: StateCaptures) -> None:
    """Each capture's conv state, the K-1 raw inputs before its point, into its slot (x [T, C])."""
    width = conv_state.shape[-1]
    rows = captures.token_ends[:, None] - width + torch.arange(width, device=x.device)  # [m, K-1]
    conv_state.index_copy_(0, captures.slots, x[rows].transpose(1, 2).to(conv_state.dtype))
