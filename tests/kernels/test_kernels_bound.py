"""Bound ops (``kernels/bound.py`` and the Triton modules' ``bind_*``) against the general path.

A binding launches the general path's kernels with the general path's arguments, the per-call
tensors put in their places, so its outputs must equal the general op's exactly. The bound
launches run on CPU under ``TRITON_INTERPRET=1`` in one child process (this file as a script),
each on fresh tensors after binding, so a binding that kept a tensor of the call it was made from
shows. The GPU runs the compiled handle path (tests/cuda/test_cuda_model.py).
"""

from __future__ import annotations

import pytest
import torch

import phalanx.kernels.bound as bound
from tests.support.interpreter_checks import report, run_interpreted

BF16 = torch.bfloat16


def _rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = BF16) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.shape != b.shape or not torch.equal(a, b))


def _linear_case(m: int) -> dict[str, float]:
    from phalanx.kernels import linear_triton as lt
    from phalanx.kernels.linear_bind_triton import bind_linear

    w, w_gate_up = _rand(37, 100, scale=0.1), _rand(74, 100, scale=0.1)
    first = _rand(m, 100)
    lt.linear_triton(first, w)  # the general call a binding follows
    plain, head = bind_linear(first, w), bind_linear(first, w, out_dtype=torch.float32)
    x = _rand(m, 100)
    errors = {
        "plain": _mismatch(plain(x, None)[0], lt.linear_triton(x, w)),
        "plain_h_is_x": float(plain(x, None)[1] is not x),
        "fp32_head": _mismatch(head(x, None)[0], lt.linear_fp32_triton(x, w)),
    }
    # One row: the pre-normed GEMV. More: the norm kernel, then the GEMM.
    residual = _rand(m, 100)
    normed = bind_linear(first, w, norm=(None, 1e-6, _rand(m, 100)))
    fused = bind_linear(first, w_gate_up, silu_mul=True, norm=(None, 1e-6, None))
    y, h = normed(x, residual)
    y_ref, h_ref = lt.rms_norm_linear_triton(x, None, 1e-6, residual, w)
    errors.update(normed=_mismatch(y, y_ref), normed_h=_mismatch(h, h_ref))
    y, h = fused(x, None)
    y_ref, h_ref = lt.rms_norm_linear_silu_and_mul_triton(x, None, 1e-6, None, w_gate_up)
    errors.update(first_layer_fused=_mismatch(y, y_ref), first_layer_fused_h=_mismatch(h, h_ref))
    return errors


def _cublas_case() -> dict[str, float]:
    """Keys the race gave to cuBLAS (set here: the interpreter never races) bind to the mm, and
    the pre-normed ones to the norm kernel, then the mm (then SiLU-and-mul). CPU torch has no
    mm with an fp32 result from bf16: the fp32 head's mm runs on the GPU only."""
    from phalanx.kernels import linear_triton as lt
    from phalanx.kernels.linear_bind_triton import bind_linear

    w, w_gate_up = _rand(37, 100, scale=0.1), _rand(74, 100, scale=0.1)
    first, x, residual = _rand(4, 100), _rand(4, 100), _rand(4, 100)
    for fused in (False, True):
        lt._cublas_faster[lt._tuning_key(first, 37, fused, None, BF16)] = True
    plain = bind_linear(first, w)
    normed = bind_linear(first, w_gate_up, silu_mul=True, norm=(None, 1e-6, residual))
    y, h = normed(x, residual)
    y_ref, h_ref = lt.rms_norm_linear_silu_and_mul_triton(x, None, 1e-6, residual, w_gate_up)
    return {
        "plain": _mismatch(plain(x, None)[0], lt.linear_triton(x, w)),
        "normed_fused": _mismatch(y, y_ref),
        "normed_fused_h": _mismatch(h, h_ref),
    }


def _wide_rows_case() -> dict[str, float]:
    """Rows past Triton's (``ops.triton_linear_rows``) share the widest Triton bucket's tuning key,
    but the general op runs them on cuBLAS: so does their binding, whatever the key's race said."""
    from phalanx.kernels import linear_bind_triton as lb
    from phalanx.kernels import ops
    from phalanx.kernels.activation_triton import silu_and_mul_triton
    from phalanx.kernels.norms_triton import rms_norm_triton

    m = ops.LINEAR_TRITON_MAX_M + 1
    w, w_gate_up = _rand(37, 100, scale=0.1), _rand(74, 100, scale=0.1)
    first, x, residual = _rand(m, 100), _rand(m, 100), _rand(m, 100)
    kernel_binds = []
    bind_kernel = lb._bind_kernel
    lb._bind_kernel = lambda *args: kernel_binds.append(args) or bind_kernel(*args)
    try:
        plain = lb.bind_linear(first, w)
        normed = lb.bind_linear(first, w_gate_up, silu_mul=True, norm=(None, 1e-6, residual))
    finally:
        lb._bind_kernel = bind_kernel
    y, h = normed(x, residual)
    normed_ref, h_ref = rms_norm_triton(x, None, 1e-6, residual)
    return {
        "triton_kernel_bound": float(len(kernel_binds)),
        "plain": _mismatch(plain(x, None)[0], torch.mm(x, w.t())),
        "normed_fused": _mismatch(y, silu_and_mul_triton(torch.mm(normed_ref, w_gate_up.t()))),
        "normed_fused_h": _mismatch(h, h_ref),
    }


def _gdn_case(batch: int) -> dict[str, float]:
    from phalanx.kernels.gdn_step_triton import bind_gdn_decode_step, gdn_decode_step_split
    from tests.kernels.test_kernels_gdn_split import _step_inputs

    names = ["mixed_qkv", "conv_weight", "conv_state", "z", "a", "b", "A_log", "dt_bias", "norm_weight"]

    def args(inputs: dict[str, torch.Tensor]) -> list[object]:
        return [*(inputs[n] for n in names), 1e-6, inputs["state"], inputs["state_slots"]]

    inputs = _step_inputs(batch, BF16)
    gdn_decode_step_split(*args(inputs))
    step = bind_gdn_decode_step(*args(inputs))
    fresh = _step_inputs(batch, BF16)
    fresh.update({n: inputs[n] for n in ("conv_weight", "A_log", "dt_bias", "norm_weight")})
    fresh["conv_state"], fresh["state"] = inputs["conv_state"], inputs["state"]
    general = {**fresh, "conv_state": fresh["conv_state"].clone(), "state": fresh["state"].clone()}
    y = step(fresh["mixed_qkv"], fresh["z"], fresh["a"], fresh["b"], fresh["state_slots"])
    y_ref = gdn_decode_step_split(*args(general))
    return {
        "y": _mismatch(y, y_ref),
        "state": _mismatch(fresh["state"], general["state"]),
        "conv_state": _mismatch(fresh["conv_state"], general["conv_state"]),
    }


def _attention_case(gated: bool) -> dict[str, float]:
    from phalanx.kernels.attention_triton import bind_paged_decode_attention, paged_decode_attention_triton

    k_cache, v_cache = _rand(24, 4, 2, 32), _rand(24, 4, 2, 32)
    table = torch.randperm(24)[:18].view(3, 6).to(torch.int32)
    seq_lens = torch.tensor([1, 13, 24], dtype=torch.int32)

    def gate() -> torch.Tensor | None:
        return _rand(3, 8, 64)[..., 32:] if gated else None

    first_q, first_gate = _rand(3, 8, 32), gate()
    paged_decode_attention_triton(first_q, k_cache, v_cache, table, seq_lens, 32**-0.5, first_gate)
    attention = bind_paged_decode_attention(first_q, k_cache, v_cache, table, seq_lens, 32**-0.5, first_gate)
    q, g = _rand(3, 8, 32), gate()
    new_table = torch.randperm(24)[:18].view(3, 6).to(torch.int32)
    new_lens = torch.tensor([20, 2, 9], dtype=torch.int32)
    out = attention(q, new_table, new_lens, g)
    ref = paged_decode_attention_triton(q, k_cache, v_cache, new_table, new_lens, 32**-0.5, g)
    return {"out": _mismatch(out, ref)}


def _norm_rope_case() -> dict[str, float]:
    from phalanx.kernels.rope import rope_cache
    from phalanx.kernels.rope_kv_triton import bind_norm_rope_write_kv, norm_rope_write_kv_triton

    cos_sin = rope_cache(64, 8, 1e4, torch.device("cpu"))
    qw, kw = _rand(32, scale=0.3), _rand(32, scale=0.3)
    caches = [_rand(6, 4, 2, 32) for _ in range(2)]

    def operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = _rand(5, 4 * 2 * 32 + 2 * 2 * 32)  # q|gate rows per head, k, v
        return (
            qkv[:, : 4 * 64].view(5, 4, 64)[..., :32],
            qkv[:, 256:320].view(5, 2, 32),
            qkv[:, 320:].view(5, 2, 32),
        )

    pos, slots = torch.tensor([0, 7, 3, 63, 12]), torch.tensor([3, 17, 0, 9, 22])
    first = operands()
    norm_rope_write_kv_triton(*first, qw, kw, 1e-6, pos, cos_sin, *caches, slots)
    write = bind_norm_rope_write_kv(*first, qw, kw, 1e-6, pos, cos_sin, *caches, slots)
    q, k, v = operands()
    new_pos, new_slots = torch.tensor([5, 1, 40, 2, 33]), torch.tensor([1, 2, 23, 8, 14])
    ref_caches = [c.clone() for c in caches]
    out = write(q, k, v, new_pos, new_slots)
    ref = norm_rope_write_kv_triton(q, k, v, qw, kw, 1e-6, new_pos, cos_sin, *ref_caches, new_slots)
    return {
        "q": _mismatch(out, ref),
        "k_cache": _mismatch(caches[0], ref_caches[0]),
        "v_cache": _mismatch(caches[1], ref_caches[1]),
    }


CASES = {
    "linear_m1": lambda: _linear_case(1),
    "linear_m3": lambda: _linear_case(3),
    "linear_cublas": _cublas_case,
    "linear_wide_rows": _wide_rows_case,
    "gdn_b1": lambda: _gdn_case(1),
    "gdn_b3": lambda: _gdn_case(3),
    "attention": lambda: _attention_case(False),
    "attention_gated": lambda: _attention_case(True),
    "norm_rope_write_kv": _norm_rope_case,
}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=240)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bound_op_equals_the_general_op_on_fresh_inputs(case: str, interpreted: dict) -> None:
    record = interpreted.get(case)
    assert record is not None, f"case {case} did not report"
    assert "exception" not in record, record.get("exception")
    differing = {name: value for name, value in record["errors"].items() if value}
    assert not differing, f"{case}: the bound op differs from the general op in {sorted(differing)}"


class _Binder:
    def __init__(self, result: object) -> None:
        self.calls, self.result = 0, result

    def __call__(self) -> object:
        self.calls += 1
        return self.result


def test_a_layout_binds_at_its_second_general_call_and_only_once() -> None:
    bindings, binder = bound._Bindings(), _Binder(result=lambda: "bound")
    bindings.after_general_call("layout", 1, binder)
    assert binder.calls == 0 and bindings.get("layout") is None
    bindings.after_general_call("layout", 1, binder)
    assert binder.calls == 1 and bindings.get("layout") is binder.result
    bindings.after_general_call("layout", 1, binder)
    assert binder.calls == 1


def test_a_layout_without_a_binding_is_asked_once_and_stays_general() -> None:
    bindings, binder = bound._Bindings(), _Binder(result=None)
    for _ in range(4):
        bindings.after_general_call("cublas", 64, binder)
    assert binder.calls == 1 and bindings.get("cublas") is None


def test_prefill_sized_layouts_never_bind() -> None:
    bindings, binder = bound._Bindings(), _Binder(result=lambda: "bound")
    for _ in range(3):
        bindings.after_general_call("prefill", bound.MAX_BOUND_ROWS + 1, binder)
    assert binder.calls == 0


def test_bound_ops_on_cpu_are_the_references() -> None:
    from phalanx.kernels import ops

    w, x, residual = torch.randn(6, 8), torch.randn(1, 8), torch.randn(1, 8)
    linear, head = bound.BoundLinear(w), bound.BoundLinear(w, fp32_out=True)
    pre_normed = bound.BoundPreNormedLinear(torch.randn(12, 8), 1e-6, silu_mul=True)
    for _ in range(3):  # past the second call, where CUDA tensors would bind
        assert torch.equal(linear(x), ops.linear(x, w))
        assert torch.equal(head(x), ops.linear_fp32(x, w))
        y, h = pre_normed(x, residual)
        y_ref, h_ref = ops.rms_norm_linear_silu_and_mul(x, None, 1e-6, residual, pre_normed.weight)
        assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    assert linear._bindings._seen == set() and pre_normed._bindings._seen == set()


if __name__ == "__main__":
    report(CASES)
