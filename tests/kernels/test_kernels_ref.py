"""Torch reference ops (kernels/*.py) against transformers' Qwen3.5 functions and dense references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from phalanx.kernels import ops
from phalanx.kernels.rope import rope_cache


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"max |diff| {err:.3e}"


def test_rms_norm_matches_hf_and_adds_residual() -> None:
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    norm = hf.Qwen3_5RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    y, h = ops.rms_norm(x, norm.weight.detach(), 1e-6)
    close(y, norm(x).detach())
    assert h is x
    y, h = ops.rms_norm(x, norm.weight.detach(), 1e-6, residual=res)
    close(h, x + res)
    close(y, norm(x + res).detach())


def test_norm_weight_folded_into_the_linear_equals_the_norm_then_the_linear() -> None:
    """The model folds each pre-norm's (1 + w) into the columns of the linear reading it: the
    pre-normed linear without a norm weight, on the folded weight, is the norm then the linear."""
    from phalanx.models.qwen35.layers import fold_norm_weight

    x, res = torch.randn(3, 64, dtype=torch.float64), torch.randn(3, 64, dtype=torch.float64)
    norm_w, w = torch.rand(64, dtype=torch.float64) - 0.5, torch.randn(40, 64, dtype=torch.float64)
    (y, h), folded = ops.rms_norm_linear(x, norm_w, 1e-6, res, w), w.clone()
    fold_norm_weight(folded, norm_w)
    y_folded, h_folded = ops.rms_norm_linear(x, None, 1e-6, res, folded)
    close(y_folded, y)
    assert torch.equal(h_folded, h) and not torch.equal(folded, w)
    fused = torch.randn(80, 64, dtype=torch.float64)
    folded_fused = fused.clone()
    fold_norm_weight(folded_fused, norm_w)
    close(
        ops.rms_norm_linear_silu_and_mul(x, None, 1e-6, res, folded_fused)[0],
        ops.rms_norm_linear_silu_and_mul(x, norm_w, 1e-6, res, fused)[0],
    )
    with pytest.raises(
        ValueError, match=r"norm weight \(32,\) does not match the columns of linear weight \(40, 64\)"
    ):
        fold_norm_weight(w, norm_w[:32])


def test_gated_rms_norm_matches_hf() -> None:
    x, z = torch.randn(6, 4, 16), torch.randn(6, 4, 16)
    norm = hf.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    close(ops.gated_rms_norm(x, z, norm.weight.detach(), 1e-6), norm(x, z).detach())


def test_silu_and_mul() -> None:
    x = torch.randn(3, 20)
    close(ops.silu_and_mul(x), F.silu(x[:, :10]) * x[:, 10:])


def test_partial_rope_matches_hf() -> None:
    rotary_dim, theta = 8, 1e7
    x = torch.randn(7, 3, 32)
    positions = torch.tensor([0, 1, 2, 50, 51, 700, 1023])
    cos_sin = rope_cache(1024, rotary_dim, theta, torch.device("cpu"))
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    want, _ = hf.apply_rotary_pos_emb(x, x, emb.cos(), emb.sin(), unsqueeze_dim=1)
    out = ops.apply_rope(x, positions, cos_sin)
    close(out, want)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_write_kv_page_slots() -> None:
    k_cache, v_cache = torch.zeros(4, 8, 2, 4), torch.zeros(4, 8, 2, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    ops.write_kv(k, v, k_cache, v_cache, torch.tensor([2 * 8 + 5, 0, 3 * 8 + 7]))
    assert torch.equal(k_cache[2, 5], k[0]) and torch.equal(v_cache[0, 0], v[1])
    assert torch.equal(k_cache[3, 7], k[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [t, H, D] at positions start.., k/v [start+t, Hkv, D]: reference causal GQA attention."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->htl", q, kk) * scale
    mask = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(q.shape[0]))[:, None]
    return torch.einsum("htl,lhd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)


def test_paged_prefill_and_decode_attention() -> None:
    page_size, heads, kv_heads, dim, scale = 4, 4, 2, 8, 8**-0.5
    k_cache, v_cache = torch.zeros(16, page_size, kv_heads, dim), torch.zeros(16, page_size, kv_heads, dim)
    lengths, starts = [9, 5], [0, 6]  # request 1 continues after 6 cached tokens
    tables = torch.tensor([[7, 2, 11, 0], [5, 13, 1, 0]], dtype=torch.int32)
    keys = [torch.randn(n + s, kv_heads, dim) for n, s in zip(lengths, starts, strict=True)]
    values = [torch.randn(n + s, kv_heads, dim) for n, s in zip(lengths, starts, strict=True)]
    for i in range(2):
        pos = torch.arange(keys[i].shape[0])
        slots = tables[i][pos // page_size].long() * page_size + pos % page_size
        ops.write_kv(keys[i], values[i], k_cache, v_cache, slots)
    queries = [torch.randn(n, heads, dim) for n in lengths]
    cu = torch.tensor([0, 9, 14], dtype=torch.int32)
    out = ops.paged_prefill_attention(
        torch.cat(queries), k_cache, v_cache, tables, cu, torch.tensor(starts, dtype=torch.int32), scale
    )
    for i in range(2):
        close(out[cu[i] : cu[i + 1]], dense_causal(queries[i], keys[i], values[i], starts[i], scale))
    # decode: the last query of each request against its whole context
    last_q = torch.stack([q[-1] for q in queries])
    seq_lens = torch.tensor([9, 11], dtype=torch.int32)
    decoded = ops.paged_decode_attention(last_q, k_cache, v_cache, tables, seq_lens, scale)
    close(decoded, torch.stack([out[8], out[13]]))


def test_causal_conv1d_chunks_and_decode_agree() -> None:
    channels, kernel, length = 6, 4, 12
    x, weight = torch.randn(length, channels), torch.randn(channels, kernel)
    padded = F.pad(x.t()[None], (kernel - 1, 0))
    want = F.silu(F.conv1d(padded, weight[:, None, :], groups=channels))[0].t()
    state = torch.zeros(3, channels, kernel - 1)
    whole = ops.causal_conv1d_prefill(
        x, weight, state, torch.tensor([1]), torch.tensor([0, length]), torch.tensor([False])
    )
    close(whole, want)
    assert torch.equal(state[1], x[-(kernel - 1) :].t())
    # Chunks shorter than K-1 hand the window over correctly, then decode continues it.
    state.zero_()
    parts, pos = [], 0
    for size in (1, 2, 1, 5):
        parts.append(
            ops.causal_conv1d_prefill(
                x[pos : pos + size],
                weight,
                state,
                torch.tensor([2]),
                torch.tensor([0, size]),
                torch.tensor([pos > 0]),
            )
        )
        pos += size
    for t in range(pos, length):
        parts.append(ops.causal_conv1d_decode(x[t : t + 1], weight, state, torch.tensor([2])))
    close(torch.cat(parts), want)


def hf_delta_rule(q, k, v, g, beta, initial_state=None):  # noqa: ANN001, ANN201
    """transformers' chunked delta rule (GVA expanded as its GatedDeltaNet does)."""
    ratio = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(ratio, 1), k.repeat_interleave(ratio, 1)
    out, state = hf.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state


def test_gdn_gating_formula_and_threshold() -> None:
    a, b = torch.tensor([[0.3, 25.0]]), torch.tensor([[-1.0, 2.0]])
    A_log, dt_bias = torch.tensor([0.5, -1.0]), torch.tensor([0.2, 1.0])
    g, beta = ops.gdn_gating(a, b, A_log, dt_bias)
    close(g[0, 0], -torch.tensor(0.5).exp() * torch.log1p(torch.tensor(0.5).exp()))
    close(g[0, 1], -torch.tensor(-1.0).exp() * 26.0)  # softplus(26) == 26 above the threshold
    close(beta, torch.sigmoid(b))
    assert g.dtype == beta.dtype == torch.float32


@pytest.mark.parametrize("split", [None, 70])
def test_gated_delta_rule_matches_hf_chunked(split: int | None) -> None:
    length, hk, hv, dk, dv = 90, 2, 4, 16, 8
    q, k, v = torch.randn(length, hk, dk), torch.randn(length, hk, dk), torch.randn(length, hv, dv)
    g = -torch.rand(length, hv) * 2
    beta = torch.rand(length, hv)
    want, want_state = hf_delta_rule(q, k, v, g, beta)
    state = torch.zeros(2, hv, dk, dv)
    slot = torch.tensor([1])
    if split is None:
        out = ops.gated_delta_rule_prefill(
            q, k, v, g, beta, state, slot, torch.tensor([0, length]), torch.tensor([False])
        )
    else:  # prefill the head, then decode the rest one token at a time
        parts = [
            ops.gated_delta_rule_prefill(
                q[:split],
                k[:split],
                v[:split],
                g[:split],
                beta[:split],
                state,
                slot,
                torch.tensor([0, split]),
                torch.tensor([False]),
            )
        ]
        for t in range(split, length):
            s = slice(t, t + 1)
            parts.append(ops.gated_delta_rule_decode(q[s], k[s], v[s], g[s], beta[s], state, slot))
        out = torch.cat(parts)
    close(out, want, 1e-4)
    close(state[1], want_state[0], 1e-4)
    assert not state[0].any()


def test_gated_delta_rule_batched_chunks_with_initial_state() -> None:
    hk, hv, dk, dv = 2, 4, 16, 8
    has_state = [True, False]  # chunk lengths 5 and 9
    q, k, v = torch.randn(14, hk, dk), torch.randn(14, hk, dk), torch.randn(14, hv, dv)
    g, beta = -torch.rand(14, hv), torch.rand(14, hv)
    initial = torch.randn(hv, dk, dv) * 0.1
    state = torch.zeros(3, hv, dk, dv)
    state[2] = initial
    out = ops.gated_delta_rule_prefill(
        q, k, v, g, beta, state, torch.tensor([2, 0]), torch.tensor([0, 5, 14]), torch.tensor(has_state)
    )
    want0, state0 = hf_delta_rule(q[:5], k[:5], v[:5], g[:5], beta[:5], initial_state=initial[None])
    want1, state1 = hf_delta_rule(q[5:], k[5:], v[5:], g[5:], beta[5:])
    close(out, torch.cat([want0, want1]), 1e-4)
    close(state[2], state0[0], 1e-4)
    close(state[0], state1[0], 1e-4)
