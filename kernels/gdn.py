"""Gated DeltaNet references: gating and the delta-rule recurrence (state [slots, Hv, dk, dv]).

The recurrent state is stored in one of ``RECURRENT_STATE_DTYPES`` and always computed in fp32: a
bf16 store halves the state's traffic, the largest part of a large decode batch's step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.kernels.varlen import StateCaptures

RECURRENT_STATE_DTYPES = (torch.float32, torch.bfloat16)


def gdn_gating_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (a log decay, <= 0), beta = sigmoid(b); both fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g, b.float().sigmoid()


def _normalise_qk(
    q: torch.Tensor, k: torch.Tensor, num_value_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q, k in fp32, scale q by dk^-1/2, and map value head h to key head h // ratio."""
    ratio = num_value_heads // q.shape[-2]
    qf, kf = q.float(), k.float()
    qf = qf * torch.rsqrt(qf.pow(2).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    kf = kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)
    return qf.repeat_interleave(ratio, dim=-2), kf.repeat_interleave(ratio, dim=-2)


def _delta_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of heads: state [..., dk, dv], q/k [..., dk], v [..., dv], g/beta [...]."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("...kv,...k->...v", state, k)
    delta = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * delta[..., None, :]
    return state, torch.einsum("...kv,...k->...v", state, q)


def gated_delta_rule_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """One token per row: q, k [B, Hk, dk], v [B, Hv, dv]; the slot states advance in place."""
    qf, kf = _normalise_qk(q, k, v.shape[1])
    new_state, out = _delta_step(state[state_slots].float(), qf, kf, v.float(), g.float(), beta.float())
    state.index_copy_(0, state_slots, new_state.to(state.dtype))
    return out.to(v.dtype)


def gated_delta_rule_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    captures: StateCaptures | None = None,
) -> torch.Tensor:
    """Per chunk, the recurrence from zero or the slot's state; the final state is written back,
    and each capture's state (taken at a block start) into its slot.

    Computed block-wise (blocks of BLOCK tokens, see ``_delta_rule_block``), which equals the token
    recurrence up to rounding.
    """
    qf, kf = _normalise_qk(q, k, v.shape[1])
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    captured: dict[tuple[int, int], int] = {}
    if captures is not None:
        slots = captures.slots.tolist()
        captured = {(c, o): slot for c, o, slot in zip(captures.chunks, captures.offsets, slots, strict=True)}
    for i, (slot, has_state) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist(), strict=True)):
        current = state[slot].float() if has_state else torch.zeros_like(state[slot], dtype=torch.float32)
        for lo in range(bounds[i], bounds[i + 1], BLOCK):
            if (i, lo - bounds[i]) in captured:
                state[captured[i, lo - bounds[i]]] = current
            hi = min(lo + BLOCK, bounds[i + 1])
            current, out[lo:hi] = _delta_rule_block(
                current, qf[lo:hi], kf[lo:hi], vf[lo:hi], gf[lo:hi], bf[lo:hi]
            )
        state[slot] = current
    return out.to(v.dtype)


BLOCK = 64


def _delta_rule_block(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of the recurrence at once: state [H, dk, dv], q/k [n, H, dk], v [n, H, dv], g/beta [n, H].

    With G the in-block cumulative log decay, the deltas d_i = beta_i (v_i - S_i'^T k_i) solve the
    unit lower-triangular system (I + A) D = beta V - beta exp(G) K S0, A_ij = beta_i e^(G_i-G_j)
    k_i.k_j (j < i); then o_i = e^(G_i) S0^T q_i + sum_{j<=i} e^(G_i-G_j) (q_i.k_j) d_j and
    S_n = e^(G_n) S0 + sum_j e^(G_n-G_j) k_j d_j^T.
    """
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, d]
    cum = g.t().cumsum(-1)  # [H, n]
    beta = beta.t().unsqueeze(-1)  # [H, n, 1]
    n = cum.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # j <= i
    strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
    system = torch.eye(n, device=q.device) + beta * (k @ k.transpose(-1, -2)) * strict
    rhs = beta * (v - cum.exp().unsqueeze(-1) * (k @ state))
    deltas = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = cum.exp().unsqueeze(-1) * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ deltas
    last = cum[:, -1:]  # [H, 1]
    new_state = (
        last.exp().unsqueeze(-1) * state + (k * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ deltas
    )
    return new_state, out.transpose(0, 1)


def split_conv_output(
    mixed: torch.Tensor, key_heads: int, key_dim: int, value_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output [T, q | k | v] as q, k [T, Hk, dk] and v [T, Hv, dv] (views)."""
    tokens, key_size = mixed.shape[0], key_heads * key_dim
    q, k, v = mixed.split([key_size, key_size, mixed.shape[1] - 2 * key_size], dim=-1)
    return (
        q.reshape(tokens, key_heads, key_dim),
        k.reshape(tokens, key_heads, key_dim),
        v.reshape(tokens, value_heads, -1),
    )


def gdn_prefill_ref(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    key_heads: int,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    captures: StateCaptures | None = None,
) -> torch.Tensor:
    """A Gated DeltaNet layer's prefill from its conv output ``mixed`` [T, q | k | v] and gate
    inputs ``a``, ``b`` [T, Hv]: ``gdn_gating_ref`` then ``gated_delta_rule_prefill_ref`` (the
    state's shape [slots, Hv, dk, dv] gives the head sizes). Output [T, Hv, dv] in mixed's dtype."""
    q, k, v = split_conv_output(mixed, key_heads, state.shape[2], state.shape[1])
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    return gated_delta_rule_prefill_ref(
        q, k, v, g, beta, state, state_slots, cu_seqlens, has_initial_state, captures
    )
