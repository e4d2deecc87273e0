"""Every Triton kernel of the model's layers against its torch reference, on CPU under
``TRITON_INTERPRET=1`` (the kernels that load a step's inputs and pick its tokens are in
``test_kernels_step_io.py``).

The interpreter must be switched on before Triton compiles anything, and must not leak into
other tests (a CUDA test in the same session would silently run interpreted). So the checks run
in one child process (this file run as a script), which prints one JSON line per check; each
pytest case asserts one of them. Small shapes, odd sizes, GQA / GVA ratios > 1, several slots.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.support.interpreter_checks import assert_within, report, run_interpreted

BF16 = torch.bfloat16


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


F32 = torch.float32


def _rand(*shape: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def check_rms_norm() -> dict[str, float]:
    from phalanx.kernels.norms import rms_norm_ref
    from phalanx.kernels.norms_triton import rms_norm_triton

    x, r, w = _rand(5, 48), _rand(5, 48), _rand(48, scale=0.3)
    y, h = rms_norm_triton(x, w, 1e-6)
    y_ref, _ = rms_norm_ref(x, w, 1e-6)
    yr, hr = rms_norm_triton(x, w, 1e-6, r)
    yr_ref, hr_ref = rms_norm_ref(x, w, 1e-6, r)
    return {
        "y": _rel(y, y_ref),
        "h_is_x": float(h.data_ptr() != x.data_ptr()),
        "y_res": _rel(yr, yr_ref),
        "h_res": _rel(hr, hr_ref),
    }


def check_gated_rms_norm() -> dict[str, float]:
    from phalanx.kernels.norms import gated_rms_norm_ref
    from phalanx.kernels.norms_triton import gated_rms_norm_triton

    x, z, w = _rand(3, 5, 16), _rand(3, 5, 16), torch.rand(16) + 0.5
    return {"y": _rel(gated_rms_norm_triton(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6))}


def check_silu_and_mul() -> dict[str, float]:
    from phalanx.kernels.activation import silu_and_mul_ref
    from phalanx.kernels.activation_triton import silu_and_mul_triton

    x = _rand(4, 80)
    return {"y": _rel(silu_and_mul_triton(x), silu_and_mul_ref(x))}


def check_apply_rope() -> dict[str, float]:
    from phalanx.kernels.rope import apply_rope_ref, rope_cache
    from phalanx.kernels.rope_triton import apply_rope_triton

    cos_sin = rope_cache(64, 8, 1e4, torch.device("cpu"))
    x = _rand(5, 3, 32)
    pos = torch.tensor([0, 7, 3, 63, 12])
    return {"y": _rel(apply_rope_triton(x, pos, cos_sin), apply_rope_ref(x, pos, cos_sin))}


def check_write_kv() -> dict[str, float]:
    from phalanx.kernels.kv_cache import write_kv_ref
    from phalanx.kernels.kv_cache_triton import write_kv_triton

    k, v = _rand(5, 2, 16), _rand(5, 2, 16)
    slots = torch.tensor([3, 17, 0, 9, 22])
    caches = [_rand(6, 4, 2, 16) for _ in range(2)]
    ref = [c.clone() for c in caches]
    write_kv_triton(k, v, caches[0], caches[1], slots)
    write_kv_ref(k, v, ref[0], ref[1], slots)
    return {"k": _rel(caches[0], ref[0]), "v": _rel(caches[1], ref[1])}


def _paged_kv(pages: int, page_size: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _rand(pages, page_size, kv_heads, dim), _rand(pages, page_size, kv_heads, dim)


def check_paged_decode_attention() -> dict[str, float]:
    from phalanx.kernels.attention import paged_decode_attention_ref
    from phalanx.kernels.attention_triton import decode_attention_with_splits, paged_decode_attention_triton

    k_cache, v_cache = _paged_kv(24, 4, 2, 32)
    page_table = torch.randperm(24)[:18].view(3, 6).to(torch.int32)
    seq_lens = torch.tensor([1, 13, 24], dtype=torch.int32)
    q = _rand(3, 8, 32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, 32**-0.5)
    out = {
        "auto": _rel(paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, 32**-0.5), ref)
    }
    for splits in (2, 3, 4):  # any count, not only powers of two (the merge masks the rest)
        got = decode_attention_with_splits(q, k_cache, v_cache, page_table, seq_lens, 32**-0.5, splits)
        out[f"splits{splits}"] = _rel(got, ref)
    # The fused output gate, read through a strided view as the model passes it.
    gate = _rand(3, 8, 64)[..., 32:]
    gated_ref = paged_decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, 32**-0.5, gate)
    for splits in (1, 4):
        got = decode_attention_with_splits(q, k_cache, v_cache, page_table, seq_lens, 32**-0.5, splits, gate)
        out[f"gated_splits{splits}"] = _rel(got, gated_ref)
    # A row of 700 keys cut into 64 splits (22 hold keys, the rest are empty); twice, bit for bit.
    long_k, long_v = _paged_kv(180, 4, 2, 32)
    long_table = torch.randperm(180)[:176].view(1, 176).to(torch.int32)
    long_args = (
        _rand(1, 8, 32),
        long_k,
        long_v,
        long_table,
        torch.tensor([700], dtype=torch.int32),
        32**-0.5,
    )
    first = decode_attention_with_splits(*long_args, 64)
    out["long_splits64"] = _rel(first, paged_decode_attention_ref(*long_args))
    out["long_repeat_differs"] = float(not torch.equal(first, decode_attention_with_splits(*long_args, 64)))
    return out


def check_decode_attention_batch_vs_bucket() -> dict[str, float]:
    """A batch of 3 run alone with a 75-page table, and inside a padded bucket of 4 with a 200-page
    table (as a CUDA graph runs it): the real rows, long enough to span several splits, agree
    exactly. In fp32, where a different cut of the keys would show (bf16 rounding hides most)."""
    from phalanx.kernels.attention_triton import paged_decode_attention_triton

    k_cache, v_cache = _rand(226, 4, 2, 32, dtype=F32), _rand(226, 4, 2, 32, dtype=F32)
    table = torch.randperm(225).view(3, 75).to(torch.int32)
    seq_lens = torch.tensor([1, 130, 300], dtype=torch.int32)
    q, gate = _rand(3, 8, 32, dtype=F32), _rand(3, 8, 32, dtype=F32)
    alone = paged_decode_attention_triton(q, k_cache, v_cache, table, seq_lens, 32**-0.5, gate)
    wide = torch.full((4, 200), 225, dtype=torch.int32)  # page 225: the padding page
    wide[:3, :75] = table
    bucket = paged_decode_attention_triton(
        torch.cat([q, _rand(1, 8, 32, dtype=F32)]),
        k_cache,
        v_cache,
        wide,
        torch.cat([seq_lens, torch.tensor([1], dtype=torch.int32)]),
        32**-0.5,
        torch.cat([gate, _rand(1, 8, 32, dtype=F32)]),
    )[:3]
    return {"exact_bucket_vs_batch": float((bucket.float() - alone.float()).abs().max())}


def check_paged_prefill_attention() -> dict[str, float]:
    from phalanx.kernels.attention import paged_prefill_attention_ref
    from phalanx.kernels.attention_prefill_triton import paged_prefill_attention_triton

    k_cache, v_cache = _paged_kv(110, 4, 2, 32)
    page_tables = torch.randperm(110)[:108].view(3, 36).to(torch.int32)
    # 140 tokens: two query blocks of 128; then a chunk after a short prefix, and a chunk of a hit
    # (10 new tokens after 60 cached); 4 padding rows past the last chunk, as a graph bucket has.
    cu = torch.tensor([0, 140, 143, 153], dtype=torch.int32)
    starts = torch.tensor([0, 5, 60], dtype=torch.int32)
    q = _rand(157, 4, 32)
    args = (q, k_cache, v_cache, page_tables, cu, starts, 32**-0.5)
    ref = paged_prefill_attention_ref(*args)[:153]
    errors = {}
    for splits in (None, 1, 2, 4, 16):  # None: the chosen count, 16 for these few programs
        out = paged_prefill_attention_triton(*args, splits=splits)
        errors[f"y_splits_{splits or 'auto'}"] = _rel(out[:153], ref)
        if splits != 1:
            errors[f"padding_not_zero_{splits or 'auto'}"] = float(bool(out[153:].any()))
    return errors


def check_conv1d_decode() -> dict[str, float]:
    from phalanx.kernels.conv1d import causal_conv1d_decode_ref
    from phalanx.kernels.conv1d_triton import causal_conv1d_decode_triton

    errors = {}
    # 300 channels: more than one program's block, the last one partly masked.
    for channels in (24, 300):
        x, w = _rand(3, channels), _rand(channels, 4, scale=0.5)
        state = _rand(5, channels, 3)
        state_ref = state.clone()
        slots = torch.tensor([2, 0, 4])
        y = causal_conv1d_decode_triton(x, w, state, slots)
        y_ref = causal_conv1d_decode_ref(x, w, state_ref, slots)
        errors[f"y_{channels}"] = _rel(y, y_ref)
        errors[f"state_{channels}"] = _rel(state, state_ref)
    return errors


def check_conv1d_prefill() -> dict[str, float]:
    from phalanx.kernels.conv1d import causal_conv1d_prefill_ref
    from phalanx.kernels.conv1d_triton import causal_conv1d_prefill_triton

    x, w = _rand(20, 24), _rand(24, 4, scale=0.5)
    slots = torch.tensor([3, 1, 0, 4])
    cu = torch.tensor([0, 5, 7, 8, 20], dtype=torch.int32)  # lengths 5, 2, 1, 12: short handoffs
    errors = {}
    # Some chunks continue a stored state (their tile gathers it); then fresh prompts only, whose
    # tiles zero the taps before each chunk's start without that gather.
    for name, init in (("resumed", [False, True, True, False]), ("fresh", [False] * 4)):
        state = _rand(5, 24, 3)
        state_ref = state.clone()
        has_init = torch.tensor(init)
        y = causal_conv1d_prefill_triton(x, w, state, slots, cu, has_init)
        y_ref = causal_conv1d_prefill_ref(x, w, state_ref, slots, cu, has_init)
        errors[f"y_{name}"] = _rel(y, y_ref)
        errors[f"state_{name}"] = _rel(state, state_ref)
    return errors


def check_conv1d_prefill_captures() -> dict[str, float]:
    """Mid-chunk state captures (prefix-cache snapshots) written by the final-state launch."""
    from phalanx.kernels.conv1d import capture_conv_states, causal_conv1d_prefill_ref
    from phalanx.kernels.conv1d_triton import causal_conv1d_prefill_triton
    from phalanx.kernels.varlen import Varlen

    lengths, starts = [5, 2, 140], [0, 4, 0]
    varlen = Varlen.build(lengths, starts, torch.device("cpu"), captures=[(2, 64, 5), (2, 128, 6)])
    x, w = _rand(sum(lengths), 24), _rand(24, 4, scale=0.5)
    state = _rand(7, 24, 3)
    state_ref = state.clone()
    slots = torch.tensor([3, 1, 0])
    args = (slots, varlen.cu_seqlens, varlen.has_initial_state)
    y = causal_conv1d_prefill_triton(x, w, state, *args, varlen)
    capture_conv_states(x, state_ref, varlen.captures)
    y_ref = causal_conv1d_prefill_ref(x, w, state_ref, *args)
    return {"y": _rel(y, y_ref), "state": _rel(state, state_ref)}


def check_gdn_gating() -> dict[str, float]:
    from phalanx.kernels.gdn import gdn_gating_ref
    from phalanx.kernels.gdn_triton import gdn_gating_triton

    a, b = _rand(5, 4, scale=8.0), _rand(5, 4)
    a[0, 0] = 30.0  # softplus threshold branch
    a_log, dt = torch.rand(4).log(), _rand(4)
    g, beta = gdn_gating_triton(a, b, a_log, dt)
    g_ref, beta_ref = gdn_gating_ref(a, b, a_log, dt)
    return {"g": _rel(g, g_ref), "beta": _rel(beta, beta_ref)}


def _gdn_inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    q, k, v = _rand(tokens, 2, 16), _rand(tokens, 2, 16), _rand(tokens, 4, 16)
    g = -torch.rand(tokens, 4) * 0.5
    beta = torch.rand(tokens, 4)
    return q, k, v, g, beta


def check_delta_rule_decode() -> dict[str, float]:
    from phalanx.kernels.gdn import gated_delta_rule_decode_ref
    from phalanx.kernels.gdn_triton import gated_delta_rule_decode_triton

    q, k, v, g, beta = _gdn_inputs(3)
    state = torch.randn(5, 4, 16, 16) * 0.1
    state_ref = state.clone()
    slots = torch.tensor([4, 0, 2])
    o = gated_delta_rule_decode_triton(q, k, v, g, beta, state, slots)
    o_ref = gated_delta_rule_decode_ref(q, k, v, g, beta, state_ref, slots)
    return {"o": _rel(o, o_ref), "state": _rel(state, state_ref)}


def check_delta_rule_prefill() -> dict[str, float]:
    from phalanx.kernels.gdn import gated_delta_rule_prefill_ref
    from phalanx.kernels.gdn_triton import gated_delta_rule_prefill_triton

    q, k, v, g, beta = _gdn_inputs(9)
    state = torch.randn(5, 4, 16, 16) * 0.1
    state_ref = state.clone()
    slots = torch.tensor([1, 3, 0])
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    init = torch.tensor([True, False, True])
    args = (slots, cu, init)
    o = gated_delta_rule_prefill_triton(q, k, v, g, beta, state, *args)
    o_ref = gated_delta_rule_prefill_ref(q, k, v, g, beta, state_ref, *args)
    return {"o": _rel(o, o_ref), "state": _rel(state, state_ref)}


def check_gdn_decode_step() -> dict[str, float]:
    from phalanx.kernels.gdn_step import gdn_decode_step_ref
    from phalanx.kernels.gdn_step_triton import gdn_decode_step_triton

    errors = {}
    # The step rounds q, k, v and o to the model dtype between stages, as the unfused chain does;
    # the interpreter's bf16 rounding differs from torch's, so the tight state check runs in fp32.
    for dtype, tag in ((torch.float32, "fp32"), (BF16, "bf16")):
        batch, conv_dim = 3, 2 * 2 * 16 + 4 * 16
        mixed, cw = _rand(batch, conv_dim, dtype=dtype), _rand(conv_dim, 4, dtype=dtype, scale=0.5)
        z, a, b = _rand(batch, 4, 16, dtype=dtype), _rand(batch, 4, dtype=dtype), _rand(batch, 4, dtype=dtype)
        a_log, dt, nw = torch.rand(4).log(), _rand(4, dtype=dtype), torch.rand(16) + 0.5
        conv_state, state = _rand(5, conv_dim, 3, dtype=dtype), torch.randn(5, 4, 16, 16) * 0.1
        conv_ref, state_ref = conv_state.clone(), state.clone()
        slots = torch.tensor([3, 0, 1])
        y = gdn_decode_step_triton(mixed, cw, conv_state, z, a, b, a_log, dt, nw, 1e-6, state, slots)
        y_ref = gdn_decode_step_ref(mixed, cw, conv_ref, z, a, b, a_log, dt, nw, 1e-6, state_ref, slots)
        errors[f"y_{tag}"] = _rel(y, y_ref)
        errors[f"conv_state_{tag}"] = _rel(conv_state, conv_ref)
        errors["state" if tag == "fp32" else "state_after_bf16_stages"] = _rel(state, state_ref)
    return errors


def check_norm_rope_write_kv() -> dict[str, float]:
    from phalanx.kernels.rope import rope_cache
    from phalanx.kernels.rope_kv import norm_rope_write_kv_ref
    from phalanx.kernels.rope_kv_triton import norm_rope_write_kv_triton

    cos_sin = rope_cache(64, 8, 1e4, torch.device("cpu"))
    qkv = _rand(5, 4 * 2 * 32 + 2 * 2 * 32)  # a fused projection output: q|gate rows per head, k, v
    q = qkv[:, : 4 * 64].view(5, 4, 64)[..., :32]
    k, v = qkv[:, 256:320].view(5, 2, 32), qkv[:, 320:].view(5, 2, 32)
    qw, kw = _rand(32, scale=0.3), _rand(32, scale=0.3)
    pos, slots = torch.tensor([0, 7, 3, 63, 12]), torch.tensor([3, 17, 0, 9, 22])
    caches = [_rand(6, 4, 2, 32) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    out = norm_rope_write_kv_triton(q, k, v, qw, kw, 1e-6, pos, cos_sin, *caches, slots)
    ref = norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, pos, cos_sin, *ref_caches, slots)
    return {
        "q": _rel(out, ref),
        "k_cache": _rel(caches[0], ref_caches[0]),
        "v_cache": _rel(caches[1], ref_caches[1]),
    }


def check_embedding() -> dict[str, float]:
    from phalanx.kernels.embedding import embedding_ref
    from phalanx.kernels.embedding_triton import embedding_triton

    weight = _rand(11, 1500)  # wider than one program's block
    # Inside this rank's slice [20, 31), below and above it (another rank's rows: zeros).
    tokens = torch.tensor([20, 30, 25, 3, 31, 40, 20])
    out = embedding_triton(tokens, weight, 20)
    ref = embedding_ref(tokens, weight, 20)
    return {
        "rows_differ": float(out.dtype != weight.dtype or not torch.equal(out, ref)),
        "outside_not_zero": float(bool(out[3:6].any())),
    }


CHECKS: dict[str, Callable[[], dict[str, float]]] = {
    name.removeprefix("check_"): fn for name, fn in list(globals().items()) if name.startswith("check_")
}
# bf16 outputs: relative error within bf16 rounding; fp32 state much tighter.
# The fused step's bf16 run rounds four intermediates; the interpreter rounds to bf16 by
# truncation (torch rounds to nearest), so its chain drifts further than on a GPU.
TOLERANCE = {
    "exact_bucket_vs_batch": 0.0,
    "rows_differ": 0.0,
    "outside_not_zero": 0.0,
    **{f"padding_not_zero_{splits}": 0.0 for splits in ("auto", 2, 4, 16)},
    "long_repeat_differs": 0.0,
    "state": 1e-3,
    "g": 1e-5,
    "beta": 1e-5,
    "h_is_x": 0.5,
    "y_bf16": 2e-2,
}
DEFAULT_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=240)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_triton_kernel_matches_reference(
    name: str, interpreted_results: dict[str, dict[str, object]]
) -> None:
    assert_within(interpreted_results, name, TOLERANCE, DEFAULT_TOLERANCE)


@pytest.mark.parametrize("splits", (0, 65))
def test_decode_attention_refuses_split_counts_the_merge_cannot_hold(splits: int) -> None:
    from phalanx.kernels.attention_triton import decode_attention_with_splits

    k_cache, v_cache = _paged_kv(4, 4, 2, 32)
    q = _rand(1, 8, 32)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"decode attention splits must be 1 to 64, got {splits}"):
        decode_attention_with_splits(q, k_cache, v_cache, table, lens, 32**-0.5, splits)


@pytest.mark.parametrize("splits", (0, 3, 32))
def test_prefill_attention_refuses_a_split_count_not_a_power_of_two_up_to_16(splits: int) -> None:
    from phalanx.kernels.attention_prefill_triton import paged_prefill_attention_triton

    k_cache, v_cache = _paged_kv(4, 4, 2, 32)
    cu, starts = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=f"prefill attention splits must be a power of two up to 16, got {splits}"
    ):
        paged_prefill_attention_triton(
            _rand(3, 8, 32),
            k_cache,
            v_cache,
            torch.zeros(1, 1, dtype=torch.int32),
            cu,
            starts,
            1.0,
            splits=splits,
        )


@pytest.mark.parametrize(
    ("tokens", "heads", "splits"),
    [
        (128, 16, 8),  # a prefix hit's 128 new tokens at the 4B geometry: 16 programs alone
        (256, 16, 4),  # a hit's 200 new tokens in its prefill graph, beside a 56-token padding chunk
        (512, 16, 2),  # a fresh 512-token prompt
        (128, 4, 16),  # four heads (a TP 4 shard of the 4B): 4 programs, 33 wanted, 16 at most
        (4096, 16, 1),  # a 4,096-token prompt fills the GPU by itself
        (16 * 512, 16, 1),  # sixteen 512-token prompts in one pass
        (1, 1, 16),  # never more than 16
    ],
)
def test_prefill_splits_fill_the_gpu_from_launch_sizes(tokens: int, heads: int, splits: int) -> None:
    from phalanx.kernels.attention_prefill_triton import prefill_splits

    assert prefill_splits(tokens, heads) == splits


if __name__ == "__main__":
    report(CHECKS)
