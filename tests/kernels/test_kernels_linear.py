"""The Triton linears (GEMV, skinny GEMM, fused gate_up + SiLU-and-mul) against their references.

Runs on CPU under ``TRITON_INTERPRET=1`` in one child process (this file as a script), like
test_kernels_triton.py: the interpreter must be on before Triton compiles anything and must not
leak into other tests. Row counts cover each path (the GEMV at M = 1; the tl.dot GEMM with padded
rows at 3, 8 and 17, full at 64, and with more rows than one block at 80), sizes that are not
multiples of any block, and non-contiguous x rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.interpreter_checks import import_error, report, run_interpreted

BF16 = torch.bfloat16
ROWS = (1, 3, 8, 17, 64, 80)
SHAPES = ((37, 100), (19, 130))  # (N, K) of the plain linear; the fused op gets [2N, K]
TOLERANCE = 1e-2  # relative, bf16 outputs
# The pre-normed ops round twice in bf16 (x + residual, then the norm's output), and the interpreter
# rounds fp32 -> bf16 toward zero where the GPU rounds to nearest even: two truncations drift more.
NORM_TOLERANCE = 2e-2


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def _case(m: int, n: int, k: int) -> dict[str, float]:
    from phalanx.kernels.linear import (
        linear_fp32_ref,
        linear_ref,
        linear_silu_and_mul_ref,
        rms_norm_linear_ref,
        rms_norm_linear_silu_and_mul_ref,
    )
    from phalanx.kernels.linear_triton import (
        linear_fp32_triton,
        linear_silu_and_mul_triton,
        linear_triton,
        rms_norm_linear_silu_and_mul_triton,
        rms_norm_linear_triton,
    )

    x = torch.randn(m, k).to(BF16)
    w = (torch.randn(n, k) * k**-0.5).to(BF16)
    w_gate_up = (torch.randn(2 * n, k) * k**-0.5).to(BF16)
    strided_x = torch.randn(m, k + 9).to(BF16)[:, 3 : 3 + k]  # row stride != K
    residual, norm = torch.randn(m, k).to(BF16), (torch.randn(k) * 0.1).to(BF16)
    errors = {
        "linear": _rel(linear_triton(x, w), linear_ref(x, w)),
        "fused": _rel(linear_silu_and_mul_triton(x, w_gate_up), linear_silu_and_mul_ref(x, w_gate_up)),
        "strided_x": _rel(linear_triton(strided_x, w), linear_ref(strided_x, w)),
    }
    # The vocab head's fp32 logits: float32, and the sums kept (bf16 rounding alone is ~2e-3).
    logits = linear_fp32_triton(x, w)
    errors["fp32_dtype"] = float(logits.dtype != torch.float32)
    errors["fp32_rounded"] = float(_rel(logits, linear_fp32_ref(x, w)) > 1e-4)
    # The pre-norm in the prologue: with a residual (h written), without one, with strided x, and
    # with no norm weight (the model's, folded into the linear's columns).
    for name, op, ref, weight in (
        ("norm", rms_norm_linear_triton, rms_norm_linear_ref, w),
        ("norm_fused", rms_norm_linear_silu_and_mul_triton, rms_norm_linear_silu_and_mul_ref, w_gate_up),
    ):
        for variant, inp, res, nw in (
            ("", x, residual, norm),
            ("_no_residual", x, None, norm),
            ("_strided", strided_x, residual, norm),
            ("_unit_weight", x, residual, None),
        ):
            (y, h), (y_ref, h_ref) = op(inp, nw, 1e-6, res, weight), ref(inp, nw, 1e-6, res, weight)
            errors[name + variant] = _rel(y, y_ref)
            errors[name + variant + "_h"] = _rel(h, h_ref)
    return errors


def _split_k_case(m: int) -> dict[str, float]:
    """The skinny GEMM with K cut in 3 (kernels/linear_split_k.py): K = 100 in BLOCK_K = 32 steps
    gives shares of 64, 36 and nothing (an empty split still arrives); plain and fused with SiLU."""
    from phalanx.kernels import linear_split_k, linear_triton
    from phalanx.kernels.linear import linear_ref, linear_silu_and_mul_ref

    x = torch.randn(m, 100).to(BF16)
    w, w_gate_up = (torch.randn(37, 100) * 0.1).to(BF16), (torch.randn(74, 100) * 0.1).to(BF16)
    linear_triton.INTERPRETER_SPLIT_K = 3
    try:
        first, second = linear_triton.linear_triton(x, w), linear_triton.linear_triton(x, w)
        fused = linear_triton.linear_silu_and_mul_triton(x, w_gate_up)
    finally:
        linear_triton.INTERPRETER_SPLIT_K = 1
    _, arrivals = linear_split_k._WORKSPACE.current[x.device]
    return {
        "split_k": _rel(first, linear_ref(x, w)),
        "split_k_repeat_differs": float(not torch.equal(first, second)),
        "split_k_counters_left": float(arrivals.count_nonzero()),
        "split_k_fused": _rel(fused, linear_silu_and_mul_ref(x, w_gate_up)),
    }


def _persistent_gemv_case(n: int, k: int) -> dict[str, float]:
    """The GEMV with a persistent grid (``PER_SM`` programs per SM; the interpreter counts 4 SMs):
    with 2 per SM and BLOCK_N = 16, up to 8 programs share the N rows unevenly, each over one or
    several row blocks, the last one partly masked. Every output row must be written (the output
    is poisoned with NaN first), plain, fused with SiLU and pre-normed."""
    from phalanx.kernels import linear_triton

    linear_triton.INTERPRETER_GEMV_PER_SM = 2
    try:
        errors = _case(1, n, k)
        x, w = torch.randn(1, k).to(BF16), (torch.randn(n, k) * k**-0.5).to(BF16)
        out = torch.full((1, n), float("nan")).to(BF16)
        linear_triton.linear_triton(x, w, out=out)
        errors["rows_unwritten"] = float(torch.isnan(out).sum())
    finally:
        linear_triton.INTERPRETER_GEMV_PER_SM = 0
    return errors


def _wide_normed_case(n: int, k: int) -> dict[str, float]:
    """A pre-normed row wider than the pre-normed GEMV takes (its limit lowered to 64 here): the
    norm kernel, then the plain GEMV, plain and fused, with the residual stream it leaves."""
    from phalanx.kernels import linear_gemv_triton, linear_triton
    from phalanx.kernels.linear import rms_norm_linear_ref, rms_norm_linear_silu_and_mul_ref

    x, residual = torch.randn(1, k).to(BF16), torch.randn(1, k).to(BF16)
    norm = (torch.randn(k) * 0.1).to(BF16)
    w, w_gate_up = (torch.randn(n, k) * k**-0.5).to(BF16), (torch.randn(2 * n, k) * k**-0.5).to(BF16)
    kinds: list[str] = []
    run = linear_triton._run
    linear_triton._run = lambda kind, *rest: (kinds.append(kind), run(kind, *rest))[1]
    widest = linear_gemv_triton.NORMED_MAX_K
    linear_gemv_triton.NORMED_MAX_K = 64
    try:
        errors = {}
        for name, op, ref, weight in (
            ("norm", linear_triton.rms_norm_linear_triton, rms_norm_linear_ref, w),
            (
                "norm_fused",
                linear_triton.rms_norm_linear_silu_and_mul_triton,
                rms_norm_linear_silu_and_mul_ref,
                w_gate_up,
            ),
        ):
            (y, h), (y_ref, h_ref) = op(x, norm, 1e-6, residual, weight), ref(x, norm, 1e-6, residual, weight)
            errors[name], errors[name + "_h"] = _rel(y, y_ref), _rel(h, h_ref)
        errors["kernels_not_the_plain_gemv"] = float(kinds != ["gemv", "gemv"])
    finally:
        linear_gemv_triton.NORMED_MAX_K = widest
        linear_triton._run = run
    return errors


CASES = {f"m{m}_n{n}_k{k}": (lambda m=m, n=n, k=k: _case(m, n, k)) for m in ROWS for n, k in SHAPES}
CASES.update({f"split_k_m{m}": (lambda m=m: _split_k_case(m)) for m in (3, 17, 80)})
PERSISTENT_SHAPES = ((300, 100), (37, 130))  # 8 programs of 37-38 rows in 3 blocks; 3 of 12-13 rows
CASES["wide_normed"] = lambda: _wide_normed_case(37, 100)
CASES.update(
    {f"persistent_n{n}_k{k}": (lambda n=n, k=k: _persistent_gemv_case(n, k)) for n, k in PERSISTENT_SHAPES}
)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=240)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_triton_linear_matches_reference(
    m: int, n: int, k: int, interpreted: dict[str, dict[str, object]]
) -> None:
    record = interpreted.get(f"m{m}_n{n}_k{k}")
    assert record is not None, f"case m={m} n={n} k={k} did not report"
    assert "exception" not in record, record.get("exception")
    errors = record["errors"]
    assert isinstance(errors, dict)
    for key, err in errors.items():
        bound = NORM_TOLERANCE if key.startswith("norm") else TOLERANCE
        assert err <= bound, f"m={m} n={n} k={k} {key}: relative error {err:.3g} > {bound}"


@pytest.mark.parametrize("n,k", PERSISTENT_SHAPES)
def test_persistent_gemv_writes_every_row_and_matches_reference(
    n: int, k: int, interpreted: dict[str, dict[str, object]]
) -> None:
    record = interpreted.get(f"persistent_n{n}_k{k}")
    assert record is not None and "exception" not in record, record
    errors = record["errors"]
    assert isinstance(errors, dict)
    assert errors.pop("rows_unwritten") == 0.0, "the persistent GEMV left output rows unwritten"
    for key, err in errors.items():
        bound = NORM_TOLERANCE if key.startswith("norm") else TOLERANCE
        assert err <= bound, f"persistent n={n} k={k} {key}: relative error {err:.3g} > {bound}"


def test_pre_normed_row_wider_than_the_normed_gemv_takes_norm_kernel_then_plain_gemv(
    interpreted: dict[str, dict[str, object]],
) -> None:
    record = interpreted.get("wide_normed")
    assert record is not None and "exception" not in record, record
    errors = record["errors"]
    assert isinstance(errors, dict)
    assert errors.pop("kernels_not_the_plain_gemv") == 0.0, "a wide pre-normed row did not run the plain GEMV"
    for key, err in errors.items():
        assert err <= NORM_TOLERANCE, (
            f"wide pre-normed row {key}: relative error {err:.3g} > {NORM_TOLERANCE}"
        )


@pytest.mark.parametrize("m", (3, 17, 80))
def test_split_k_gemm_sums_every_split_and_resets_its_counters(
    m: int, interpreted: dict[str, dict[str, object]]
) -> None:
    record = interpreted.get(f"split_k_m{m}")
    assert record is not None and "exception" not in record, record
    errors = record["errors"]
    assert isinstance(errors, dict)
    assert errors["split_k"] <= TOLERANCE and errors["split_k_fused"] <= TOLERANCE, errors
    assert errors["split_k_repeat_differs"] == 0.0, "two launches of the same split-K GEMM differ"
    assert errors["split_k_counters_left"] == 0.0, "a split-K launch left arrival counters set"


def test_cpu_dispatch_uses_the_references() -> None:
    from phalanx.kernels import ops
    from phalanx.kernels.linear import (
        linear_ref,
        linear_silu_and_mul_ref,
        rms_norm_linear_ref,
        rms_norm_linear_silu_and_mul_ref,
    )

    x, w = torch.randn(3, 16), torch.randn(10, 16)
    assert torch.equal(ops.linear(x, w), linear_ref(x, w))
    assert torch.equal(ops.linear_silu_and_mul(x, w), linear_silu_and_mul_ref(x, w))
    assert ops.linear_silu_and_mul(x, w).shape == (3, 5)
    norm, residual = torch.randn(16), torch.randn(3, 16)
    for fused, ref in (
        (ops.rms_norm_linear, rms_norm_linear_ref),
        (ops.rms_norm_linear_silu_and_mul, rms_norm_linear_silu_and_mul_ref),
    ):
        (y, h), (y_ref, h_ref) = fused(x, norm, 1e-6, residual, w), ref(x, norm, 1e-6, residual, w)
        assert torch.equal(y, y_ref) and torch.equal(h, h_ref)


def test_linear_writes_into_a_given_out_buffer_of_its_exact_shape() -> None:
    from phalanx.kernels import ops
    from phalanx.kernels.linear import linear_ref

    x, w = torch.randn(3, 16), torch.randn(10, 16)
    out = torch.empty(3, 10)
    assert ops.linear(x, w, out=out) is out and torch.equal(out, linear_ref(x, w))
    with pytest.raises(
        ValueError,
        match=r"linear: out \(3, 9\) torch.float32 on cpu is not a contiguous \(3, 10\) torch.float32 on cpu",
    ):
        ops.linear(x, w, out=torch.empty(3, 9))
    with pytest.raises(ValueError, match="is not a contiguous"):
        ops.linear(x, w, out=torch.empty(10, 3).t())


def test_fp32_linear_keeps_the_sums_in_float32_on_cpu() -> None:
    from phalanx.kernels import ops

    x, w = torch.randn(3, 16).to(BF16), torch.randn(10, 16).to(BF16)
    logits = ops.linear_fp32(x, w)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, x.double().matmul(w.double().t()).float(), rtol=1e-5, atol=1e-5)
    x32, w32 = x.float(), w.float()
    assert torch.equal(ops.linear_fp32(x32, w32), torch.nn.functional.linear(x32, w32))


def test_triton_linear_rejects_mismatched_shapes() -> None:
    from phalanx.kernels.linear_triton import linear_silu_and_mul_triton, linear_triton

    with pytest.raises(ValueError, match=r"linear: x \(2, 8\) and w \(4, 6\) are not \[M, K\] and \[N, K\]"):
        linear_triton(torch.zeros(2, 8), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="linear_silu_and_mul: gate_up weight has an odd row count 5"):
        linear_silu_and_mul_triton(torch.zeros(2, 8), torch.zeros(5, 8))
    with pytest.raises(ValueError, match="must have contiguous rows"):
        linear_triton(torch.zeros(2, 8), torch.zeros(8, 4).t())


def test_unknown_linear_backend_is_refused() -> None:
    stderr = import_error("phalanx.kernels.ops", {"PHALANX_LINEAR": "magma"})
    assert "PHALANX_LINEAR='magma' is not one of auto, cublas, triton" in stderr


if __name__ == "__main__":
    report(CASES)


def test_the_race_times_both_sides_in_turn_so_a_rising_clock_slows_both_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Graphs and replays faked (they need a GPU): both sides cost the same at full clock, and the
    clock rises from half speed over the race's first replays, as on a GPU coming out of idle."""
    from phalanx.kernels import linear_race

    cost = {None: 40.0, "triton": 60.0, "cublas": 60.0}  # µs per call at full clock; None: the flush
    replays = iter(range(1000))
    monkeypatch.setattr(linear_race, "_graph", lambda run: run())
    monkeypatch.setattr(
        linear_race, "_replay_us", lambda graph: cost[graph] * max(1.0, 2.0 - next(replays) / 10)
    )
    assert linear_race._race_us(lambda: "triton", lambda: "cublas") == [20.0, 20.0]


def test_a_key_where_cublas_measured_faster_takes_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race between the tuned Triton kernel and cuBLAS (timings faked: it runs on a GPU) and
    the dispatch that follows its answer."""
    from phalanx.kernels import linear_race, linear_triton

    monkeypatch.setattr(linear_race, "_race_us", lambda *runs: [2.0, 1.0])  # Triton, cuBLAS: cuBLAS faster
    key = ("gemm", 10, 16, 16, False, "none", torch.float32, torch.float32)
    shape = {"N": "10", "K": "16"}
    assert linear_race.cublas_beats_triton("gemm", shape, None, lambda: None, lambda: None) is True
    monkeypatch.setenv("PHALANX_LINEAR", "triton")
    assert linear_race.cublas_beats_triton("gemm", shape, None, lambda: None, lambda: None) is False

    monkeypatch.setitem(linear_triton._cublas_faster, key, True)
    x, w = torch.randn(3, 16), torch.randn(10, 16)
    y, h = linear_triton._launch(x, w, 10, silu_mul=False)
    assert torch.equal(y, torch.nn.functional.linear(x, w)) and h is x
