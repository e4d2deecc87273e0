"""Every Triton kernel at the 4B geometry's real shapes against its torch reference, on the GPU.

bf16 outputs: relative error (‖out − ref‖ / ‖ref‖) ≤ 1e-2; fp32 recurrent state ≤ 1e-3.
The references run on the same GPU tensors (they are plain torch)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import globaltimer  # noqa: E402

from phalanx.kernels.launch import wait_for_producer  # noqa: E402
from tests.support.gpu_checks import rand, rel  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
OUT_TOL = 1e-2
STATE_TOL = 1e-3
# 4B, TP 1
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 2560, 9216, 16, 4, 256
HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV
PAGE = 64


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_rms_norm() -> None:
    from phalanx.kernels.norms import rms_norm_ref
    from phalanx.kernels.norms_triton import rms_norm_triton

    x, r, w = rand(64, HIDDEN), rand(64, HIDDEN), rand(HIDDEN, scale=0.1)
    y, h = rms_norm_triton(x, w, 1e-6, r)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert rel(y, y_ref) <= OUT_TOL and rel(h, h_ref) <= OUT_TOL
    q = rand(64 * HEADS, HEAD_DIM)
    assert rel(rms_norm_triton(q, w[:HEAD_DIM], 1e-6)[0], rms_norm_ref(q, w[:HEAD_DIM], 1e-6)[0]) <= OUT_TOL
    # No weight: the model's pre-norms, whose (1 + w) is folded into the next linear.
    y, h = rms_norm_triton(x, None, 1e-6, r)
    y_ref, h_ref = rms_norm_ref(x, None, 1e-6, r)
    assert (
        rel(y, y_ref) <= OUT_TOL
        and rel(h, h_ref) <= OUT_TOL
        and rel(y, rms_norm_ref(x, w, 1e-6, r)[0]) > OUT_TOL
    )


def test_gated_rms_norm_with_strided_gate() -> None:
    from phalanx.kernels.norms import gated_rms_norm_ref
    from phalanx.kernels.norms_triton import gated_rms_norm_triton

    x = rand(64, HV, DV)
    z = rand(64, HV * DV + 64)[:, : HV * DV].reshape(64, HV, DV)  # a column slice, as the model passes it
    w = torch.rand(DV, device=DEV) + 0.5
    assert rel(gated_rms_norm_triton(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6)) <= OUT_TOL


def test_silu_and_mul() -> None:
    from phalanx.kernels.activation import silu_and_mul_ref
    from phalanx.kernels.activation_triton import silu_and_mul_triton

    x = rand(64, 2 * INTER)
    assert rel(silu_and_mul_triton(x), silu_and_mul_ref(x)) <= OUT_TOL


def test_apply_rope_and_write_kv() -> None:
    from phalanx.kernels.kv_cache import write_kv_ref
    from phalanx.kernels.kv_cache_triton import write_kv_triton
    from phalanx.kernels.rope import apply_rope_ref, rope_cache
    from phalanx.kernels.rope_triton import apply_rope_triton

    cos_sin = rope_cache(32768, 64, 1e7, DEV)
    x = rand(77, HEADS, HEAD_DIM)
    pos = torch.randint(0, 32768, (77,), device=DEV)
    assert rel(apply_rope_triton(x, pos, cos_sin), apply_rope_ref(x, pos, cos_sin)) <= OUT_TOL
    k, v = rand(77, KV_HEADS, HEAD_DIM), rand(77, KV_HEADS, HEAD_DIM)
    caches = [rand(40, PAGE, KV_HEADS, HEAD_DIM) for _ in range(2)]
    refs = [c.clone() for c in caches]
    slots = torch.randperm(40 * PAGE, device=DEV)[:77]
    write_kv_triton(k, v, *caches, slots)
    write_kv_ref(k, v, *refs, slots)
    assert torch.equal(caches[0], refs[0]) and torch.equal(caches[1], refs[1])


def test_embedding_at_the_vocab_shape_with_another_ranks_tokens() -> None:
    from phalanx.kernels.embedding import embedding_ref
    from phalanx.kernels.embedding_triton import embedding_triton

    vocab = 248320
    weight = rand(vocab // 2, HIDDEN)  # rank 1 of TP 2: rows [vocab / 2, vocab)
    tokens = torch.randint(0, vocab, (64,), device=DEV)
    out = embedding_triton(tokens, weight, vocab // 2)
    assert torch.equal(out, embedding_ref(tokens, weight, vocab // 2))
    assert not out[tokens < vocab // 2].any()


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_decode_kv_indices(rows: int) -> None:
    from phalanx.kernels.kv_cache import decode_kv_indices_ref
    from phalanx.kernels.kv_cache_triton import decode_kv_indices_triton

    positions = torch.randint(0, 40 * PAGE, (rows,), device=DEV)
    table = torch.randint(0, 10_000, (rows, 48), dtype=torch.int32, device=DEV)[:, :40]
    for got, want in zip(
        decode_kv_indices_triton(positions, table, PAGE),
        decode_kv_indices_ref(positions, table, PAGE),
        strict=True,
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_paged_decode_attention(batch: int) -> None:
    from phalanx.kernels.attention import paged_decode_attention_ref
    from phalanx.kernels.attention_triton import decode_attention_with_splits, paged_decode_attention_triton

    pages_per_row = 40
    k_cache, v_cache = (
        rand(batch * pages_per_row + 1, PAGE, KV_HEADS, HEAD_DIM),
        rand(batch * pages_per_row + 1, PAGE, KV_HEADS, HEAD_DIM),
    )
    table = torch.randperm(batch * pages_per_row + 1, device=DEV)[: batch * pages_per_row]
    table = table.view(batch, pages_per_row).to(torch.int32)
    lens = torch.randint(1, pages_per_row * PAGE + 1, (batch,), device=DEV, dtype=torch.int32)
    q = rand(batch, HEADS, HEAD_DIM)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5)
    assert (
        rel(paged_decode_attention_triton(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5), ref) <= OUT_TOL
    )
    for splits in (1, 8):
        got = decode_attention_with_splits(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, splits)
        assert rel(got, ref) <= OUT_TOL
    gate = rand(batch, HEADS, 2 * HEAD_DIM)[..., HEAD_DIM:]  # a strided view, as the model passes it
    gated_ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, gate)
    for splits in (1, 8):
        got = decode_attention_with_splits(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, splits, gate)
        assert rel(got, gated_ref) <= OUT_TOL, f"gated, {splits} splits"


@triton.jit
def _slow_kv_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, D: tl.constexpr, SPIN_NS: tl.constexpr, USE_PDL: tl.constexpr
):
    """A test double for the KV write before decode attention: under PDL it lets attention start,
    then stalls for ``SPIN_NS`` before storing each row's newest K and V, so attention's reads
    before its wait see the old cache for certain (the real write is over in about a µs)."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    wait_for_producer(USE_PDL)
    start = globaltimer()
    while globaltimer() - start < SPIN_NS:
        pass
    d = tl.arange(0, D)
    src = (t * heads + head) * D + d
    dst = (tl.load(slots_ptr + t) * heads + head) * D + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + src))
    tl.store(vc_ptr + dst, tl.load(v_ptr + src))


def test_decode_attention_reads_the_newest_token_after_the_kv_write_under_pdl() -> None:
    """Under PDL decode attention starts while the kernel before it still runs and reads the
    lengths and page tables before waiting for it; that kernel writes each row's newest K and V,
    so the cache must be read after the wait. Before each replay the newest slots hold huge
    values, and the writer stalls before replacing them: a read too early shows in the output."""
    from phalanx.kernels.attention import paged_decode_attention_ref
    from phalanx.kernels.attention_triton import paged_decode_attention_triton
    from phalanx.kernels.kv_cache_triton import decode_kv_indices_triton
    from phalanx.kernels.launch import FastLaunch, pdl_enabled

    assert pdl_enabled() == (torch.cuda.get_device_capability()[0] >= 9)
    write = FastLaunch(_slow_kv_write_kernel, pdl=True)
    batch, pages_per_row, hd, scale = 4, 8, HEAD_DIM, HEAD_DIM**-0.5
    table = torch.randperm(batch * pages_per_row, device=DEV).view(batch, pages_per_row).to(torch.int32)
    positions = torch.tensor([5, 64, 300, 511], device=DEV)  # page starts, middles and ends
    slots, lens = decode_kv_indices_triton(positions, table, PAGE)
    k_cache, v_cache = (rand(batch * pages_per_row, PAGE, KV_HEADS, hd) for _ in range(2))
    q, k, v = rand(batch, HEADS, hd), rand(batch, KV_HEADS, hd), rand(batch, KV_HEADS, hd)

    def step() -> torch.Tensor:
        write((batch, KV_HEADS), k, v, k_cache, v_cache, slots, hd, 20_000, num_warps=1)
        return paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale)

    step()  # compiles both kernels outside the capture
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        for cache in (k_cache, v_cache):
            cache.view(-1, KV_HEADS, hd)[slots] = 1e4
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, ref) <= OUT_TOL, "decode attention read the newest token before it was written"


# Mixed: three chunks at different starts; hit: a prefix-cache hit's 128 new tokens after 4,096
# cached, the few query blocks whose keys are split.
PREFILL_CASES = {"mixed": ([300, 1, 130], [0, 700, 1000]), "hit": ([128], [4096])}


@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
@pytest.mark.parametrize("splits", (None, 1, 16))
def test_paged_prefill_attention(case: str, splits: int | None) -> None:
    from phalanx.kernels.attention import paged_prefill_attention_ref
    from phalanx.kernels.attention_prefill_triton import paged_prefill_attention_triton

    lens, starts = PREFILL_CASES[case]
    pages_per_chunk = 70
    k_cache, v_cache = rand(256, PAGE, KV_HEADS, HEAD_DIM), rand(256, PAGE, KV_HEADS, HEAD_DIM)
    tables = (
        torch.randperm(256, device=DEV)[: len(lens) * pages_per_chunk].view(len(lens), -1).to(torch.int32)
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = rand(sum(lens), HEADS, HEAD_DIM)
    args = (
        q,
        k_cache,
        v_cache,
        tables,
        cu,
        torch.tensor(starts, dtype=torch.int32, device=DEV),
        HEAD_DIM**-0.5,
    )
    out = paged_prefill_attention_triton(*args, splits=splits)
    assert rel(out, paged_prefill_attention_ref(*args)) <= OUT_TOL


def test_conv1d_decode_and_prefill() -> None:
    from phalanx.kernels.conv1d import causal_conv1d_decode_ref, causal_conv1d_prefill_ref
    from phalanx.kernels.conv1d_triton import causal_conv1d_decode_triton, causal_conv1d_prefill_triton

    w = rand(CONV_DIM, CONV_K, scale=0.3)
    state = rand(70, CONV_DIM, CONV_K - 1)
    state_ref = state.clone()
    slots = torch.randperm(70, device=DEV)[:64]
    x = rand(64, CONV_DIM)
    y = causal_conv1d_decode_triton(x, w, state, slots)
    assert rel(y, causal_conv1d_decode_ref(x, w, state_ref, slots)) <= OUT_TOL
    assert torch.equal(state, state_ref)
    cu = torch.tensor([0, 500, 502, 503, 700], dtype=torch.int32, device=DEV)
    init = torch.tensor([False, True, True, True], device=DEV)
    x = rand(700, CONV_DIM)
    y = causal_conv1d_prefill_triton(x, w, state, slots[:4], cu, init)
    assert rel(y, causal_conv1d_prefill_ref(x, w, state_ref, slots[:4], cu, init)) <= OUT_TOL
    assert torch.equal(state, state_ref)


def test_conv1d_prefill_compiles_once_whatever_the_batch_shape() -> None:
    """Serving meets token and chunk counts in any class (1, multiples of 16, others): after the
    first launch none of them may compile the prefill conv kernels again."""
    from phalanx.kernels.conv1d_triton import causal_conv1d_prefill_triton

    w = rand(CONV_DIM, CONV_K, scale=0.3)
    state = rand(70, CONV_DIM, CONV_K - 1)
    slots = torch.randperm(70, device=DEV)

    def prefill(lengths: list[int]) -> None:
        cu = torch.tensor([0, *lengths], device=DEV).cumsum(0).to(torch.int32)
        init = torch.ones(len(lengths), dtype=torch.bool, device=DEV)
        causal_conv1d_prefill_triton(rand(sum(lengths), CONV_DIM), w, state, slots[: len(lengths)], cu, init)

    prefill([37, 5])
    compiled: list[str] = []

    def record(**kwargs: object) -> None:
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))

    saved, triton.knobs.runtime.jit_post_compile_hook = triton.knobs.runtime.jit_post_compile_hook, record
    try:
        for lengths in ([1], [16], [32, 16], [7, 9, 1], [64] * 16, [3] * 17):
            prefill(lengths)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = saved
    assert not [name for name in compiled if "conv_prefill" in name], compiled


def gdn_inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    from phalanx.kernels.gdn import gdn_gating_ref

    q, k, v = rand(tokens, HK, DK), rand(tokens, HK, DK), rand(tokens, HV, DV)
    g, beta = gdn_gating_ref(rand(tokens, HV), rand(tokens, HV), torch.rand(HV, device=DEV).log(), rand(HV))
    return q, k, v, g, beta


def test_gdn_gating() -> None:
    from phalanx.kernels.gdn import gdn_gating_ref
    from phalanx.kernels.gdn_triton import gdn_gating_triton

    a, b = rand(64, HV, scale=5.0), rand(64, HV)
    a_log, dt = torch.rand(HV, device=DEV).log(), rand(HV)
    for got, ref in zip(gdn_gating_triton(a, b, a_log, dt), gdn_gating_ref(a, b, a_log, dt), strict=True):
        assert rel(got, ref) <= 1e-5


def test_gated_delta_rule_decode() -> None:
    from phalanx.kernels.gdn import gated_delta_rule_decode_ref
    from phalanx.kernels.gdn_triton import gated_delta_rule_decode_triton

    q, k, v, g, beta = gdn_inputs(64)
    state = torch.randn(70, HV, DK, DV, device=DEV) * 0.1
    state_ref = state.clone()
    slots = torch.randperm(70, device=DEV)[:64]
    o = gated_delta_rule_decode_triton(q, k, v, g, beta, state, slots)
    assert rel(o, gated_delta_rule_decode_ref(q, k, v, g, beta, state_ref, slots)) <= OUT_TOL
    assert rel(state, state_ref) <= STATE_TOL


def test_gated_delta_rule_prefill_recurrence() -> None:
    from phalanx.kernels.gdn import gated_delta_rule_prefill_ref
    from phalanx.kernels.gdn_triton import gated_delta_rule_prefill_triton

    lens = [300, 1, 64, 100]
    q, k, v, g, beta = gdn_inputs(sum(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    init = torch.tensor([False, True, True, False], device=DEV)
    state = torch.randn(8, HV, DK, DV, device=DEV) * 0.1
    state_ref = state.clone()
    slots = torch.tensor([5, 0, 7, 2], device=DEV)
    o = gated_delta_rule_prefill_triton(q, k, v, g, beta, state, slots, cu, init)
    o_ref = gated_delta_rule_prefill_ref(q, k, v, g, beta, state_ref, slots, cu, init)
    assert rel(o, o_ref) <= OUT_TOL
    assert rel(state, state_ref) <= STATE_TOL


def test_gdn_decode_step_fused() -> None:
    from phalanx.kernels.gdn_step import gdn_decode_step_ref
    from phalanx.kernels.gdn_step_triton import gdn_decode_step_triton

    mixed = rand(64, CONV_DIM + HV * DV + 2 * HV)[:, :CONV_DIM]  # a slice of the fused projection
    cw = rand(CONV_DIM, CONV_K, scale=0.3)
    z, a, b = rand(64, HV, DV), rand(64, HV), rand(64, HV)
    a_log, dt, nw = torch.rand(HV, device=DEV).log(), rand(HV), torch.rand(DV, device=DEV) + 0.5
    conv_state, state = rand(70, CONV_DIM, CONV_K - 1), torch.randn(70, HV, DK, DV, device=DEV) * 0.1
    conv_ref, state_ref = conv_state.clone(), state.clone()
    slots = torch.randperm(70, device=DEV)[:64]
    y = gdn_decode_step_triton(mixed, cw, conv_state, z, a, b, a_log, dt, nw, 1e-6, state, slots)
    y_ref = gdn_decode_step_ref(mixed, cw, conv_ref, z, a, b, a_log, dt, nw, 1e-6, state_ref, slots)
    assert rel(y, y_ref) <= OUT_TOL
    assert torch.equal(conv_state, conv_ref)
    assert rel(state, state_ref) <= STATE_TOL


def test_norm_rope_write_kv_fused() -> None:
    from phalanx.kernels.rope import rope_cache
    from phalanx.kernels.rope_kv import norm_rope_write_kv_ref
    from phalanx.kernels.rope_kv_triton import norm_rope_write_kv_triton

    cos_sin = rope_cache(32768, 64, 1e7, DEV)
    hd = HEAD_DIM
    qkv = rand(77, HEADS * 2 * hd + 2 * KV_HEADS * hd)
    q = qkv[:, : HEADS * 2 * hd].view(77, HEADS, 2 * hd)[..., :hd]
    k = qkv[:, HEADS * 2 * hd : HEADS * 2 * hd + KV_HEADS * hd].view(77, KV_HEADS, hd)
    v = qkv[:, HEADS * 2 * hd + KV_HEADS * hd :].view(77, KV_HEADS, hd)
    qw, kw = rand(hd, scale=0.1), rand(hd, scale=0.1)
    pos = torch.randint(0, 32768, (77,), device=DEV)
    slots = torch.randperm(40 * PAGE, device=DEV)[:77]
    caches = [rand(40, PAGE, KV_HEADS, hd) for _ in range(2)]
    refs = [c.clone() for c in caches]
    out = norm_rope_write_kv_triton(q, k, v, qw, kw, 1e-6, pos, cos_sin, *caches, slots)
    ref = norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, pos, cos_sin, *refs, slots)
    assert rel(out, ref) <= OUT_TOL
    assert rel(caches[0], refs[0]) <= OUT_TOL and torch.equal(caches[1], refs[1])


def test_fast_launch_repeats_and_new_specialisations_stay_correct() -> None:
    """After the first launch of a specialisation, FastLaunch calls the compiled handle directly:
    repeated launches on fresh inputs, and inputs that need another specialisation (a misaligned
    view, a different row count), must all still match the reference."""
    from phalanx.kernels.activation import silu_and_mul_ref
    from phalanx.kernels.activation_triton import silu_and_mul_triton
    from phalanx.kernels.norms import rms_norm_ref
    from phalanx.kernels.norms_triton import rms_norm_triton

    weight = rand(HIDDEN, scale=0.1)
    for rows in (1, 1, 3, 1, 17):
        x, res = rand(rows, HIDDEN), rand(rows, HIDDEN)
        for got, ref in zip(
            rms_norm_triton(x, weight, 1e-6, res), rms_norm_ref(x, weight, 1e-6, res), strict=True
        ):
            assert rel(got, ref) <= OUT_TOL, f"rms_norm, {rows} rows"
        assert rel(rms_norm_triton(x, weight, 1e-6)[0], rms_norm_ref(x, weight, 1e-6)[0]) <= OUT_TOL
    for offset in (0, 0, 1, 0):  # offset 1: a view whose data pointer is not 16-byte aligned
        x = rand(2, 2 * INTER + 1)[:, offset : offset + 2 * INTER]
        assert rel(silu_and_mul_triton(x), silu_and_mul_ref(x)) <= OUT_TOL, f"silu_and_mul, offset {offset}"


@pytest.mark.parametrize("rows", (1, 3, 64))
def test_greedy_pick_at_the_vocab_shape_equals_argmax_and_feeds_each_slot(rows: int) -> None:
    """At Qwen3.5's vocabulary (61 programs a row): torch.argmax's tokens, ties to the smallest id
    across programs, the fed buffer written at each row's slot only; replayed in a graph too."""
    from phalanx.kernels.greedy import greedy_pick_ref
    from phalanx.kernels.greedy_triton import greedy_pick_triton

    vocab = 248320
    logits = torch.randn(rows, vocab, device=DEV)
    logits[0, [200_000, 5000, 130_000]] = 50.0  # a tie across programs: 5000 wins
    slots = torch.randperm(rows + 4, device=DEV)[:rows]
    fed, fed_ref = torch.full((rows + 4,), -1, device=DEV), torch.full((rows + 4,), -1, device=DEV)
    tokens = greedy_pick_triton(logits, slots, fed)
    assert torch.equal(tokens, greedy_pick_ref(logits, slots, fed_ref))
    assert torch.equal(fed, fed_ref) and int(tokens[0]) == 5000

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = greedy_pick_triton(logits, slots, fed)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    fed_ref.fill_(-1)
    fed.fill_(-1)
    graph.replay()
    assert torch.equal(replayed, greedy_pick_ref(logits, slots, fed_ref))
    assert torch.equal(fed, fed_ref)
