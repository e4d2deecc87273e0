"""The GDN decode step's two CUDA paths (the fused kernel; the split path: the conv kernel, then the
fused kernel without its conv) and the dispatch of ``gdn_decode_step_triton``, against
``gdn_decode_step_ref`` on CPU under ``TRITON_INTERPRET=1``.

As in ``test_kernels_triton.py`` the interpreted checks run in one child process (this file run
as a script) so the interpreter never leaks into other tests; it prints one JSON line per check.
Shapes: Hk=2, Hv=4, dk=dv=32, K=4; scattered state slots among spare ones that must stay intact;
q/k/v, z, a and b as column slices of fused projections (row strides wider than the rows).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from tests.support.interpreter_checks import assert_within, import_error, report, run_interpreted

HK, HV, DK, DV, CONV_K = 2, 4, 32, 32, 4
CONV_DIM = 2 * HK * DK + HV * DV
SLOTS = 48


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def _step_inputs(
    batch: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape) * scale).to(dtype)

    # One projection row holds [qkv | z | a | b] plus padding: every operand is a strided slice.
    width = CONV_DIM + HV * DV + 2 * HV + 8
    proj = rand(batch, width)
    return {
        "mixed_qkv": proj[:, :CONV_DIM],
        "conv_weight": rand(CONV_DIM, CONV_K, scale=0.5),
        "conv_state": rand(SLOTS, CONV_DIM, CONV_K - 1),
        "z": proj[:, CONV_DIM : CONV_DIM + HV * DV].view(batch, HV, DV),
        "a": proj[:, CONV_DIM + HV * DV : CONV_DIM + HV * DV + HV],
        "b": proj[:, CONV_DIM + HV * DV + HV : CONV_DIM + HV * DV + 2 * HV],
        "A_log": torch.rand(HV).log(),
        "dt_bias": rand(HV),
        "norm_weight": torch.rand(DV) + 0.5,
        "state": (torch.randn(SLOTS, HV, DK, DV) * 0.1).to(state_dtype),
        "state_slots": torch.randperm(SLOTS)[:batch],
    }


def _compare(
    step: Callable[..., torch.Tensor],
    batch: int,
    dtype: torch.dtype,
    state_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    from phalanx.kernels.gdn_step import gdn_decode_step_ref

    inputs = _step_inputs(batch, dtype, state_dtype)
    ref_inputs = {**inputs, "conv_state": inputs["conv_state"].clone(), "state": inputs["state"].clone()}
    names = ["mixed_qkv", "conv_weight", "conv_state", "z", "a", "b", "A_log", "dt_bias", "norm_weight"]
    tail = ["state", "state_slots"]
    y = step(*(inputs[n] for n in names), 1e-6, *(inputs[n] for n in tail))
    y_ref = gdn_decode_step_ref(*(ref_inputs[n] for n in names), 1e-6, *(ref_inputs[n] for n in tail))
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[inputs["state_slots"]] = False
    return {
        "y": _rel(y, y_ref),
        "state": _rel(inputs["state"], ref_inputs["state"]),
        "conv_state_mismatch": float(not torch.equal(inputs["conv_state"], ref_inputs["conv_state"])),
        "spare_slots_changed": float(
            not torch.equal(inputs["state"][untouched], ref_inputs["state"][untouched])
            or not torch.equal(inputs["conv_state"][untouched], ref_inputs["conv_state"][untouched])
        ),
    }


def _dispatched(batch: int, dtype: torch.dtype, expect: str, path: str) -> dict[str, float]:
    """Runs ``gdn_decode_step_triton`` with its path set as ``PHALANX_GDN=path`` sets it;
    ``wrong_path`` is 1.0 unless it took ``expect`` once."""
    from phalanx.kernels import gdn_step_triton

    taken: list[str] = []
    split, fused = gdn_step_triton.gdn_decode_step_split, gdn_step_triton.gdn_decode_step_fused

    def spy(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: object) -> torch.Tensor:
            taken.append(name)
            return fn(*args)

        return wrapped

    gdn_step_triton.gdn_decode_step_split = spy("split", split)
    gdn_step_triton.gdn_decode_step_fused = spy("fused", fused)
    saved_path, gdn_step_triton.GDN_PATH = gdn_step_triton.GDN_PATH, path
    try:
        errors = _compare(gdn_step_triton.gdn_decode_step_triton, batch, dtype)
    finally:
        gdn_step_triton.gdn_decode_step_split, gdn_step_triton.gdn_decode_step_fused = split, fused
        gdn_step_triton.GDN_PATH = saved_path
    return {**errors, "wrong_path": float(taken != [expect])}


def check_split_small_fp32() -> dict[str, float]:
    return _repeated("split", 3, torch.float32)


def check_split_whole_head_tile() -> dict[str, float]:
    """A tile as wide as dv: each program holds its whole value head and norms it from its
    registers, with no workspace and no counter."""
    from phalanx.kernels import gdn_step_triton

    saved, gdn_step_triton.INTERPRET_TILE = gdn_step_triton.INTERPRET_TILE, (DV, 4)
    try:
        return _repeated("split", 3, torch.float32)
    finally:
        gdn_step_triton.INTERPRET_TILE = saved


def check_split_small_bf16() -> dict[str, float]:
    from phalanx.kernels.gdn_step_triton import gdn_decode_step_split

    errors = _compare(gdn_decode_step_split, 3, torch.bfloat16)
    errors["state_after_bf16_stages"] = errors.pop("state")
    return errors


def check_split_bf16_state() -> dict[str, float]:
    """A bf16 recurrent state: loaded into fp32, stepped, stored rounded, as the reference does."""
    from phalanx.kernels.gdn_step_triton import gdn_decode_step_split

    errors = _compare(gdn_decode_step_split, 3, torch.bfloat16, torch.bfloat16)
    errors["state_after_bf16_stages"] = errors.pop("state")
    return errors


def check_fused_bf16_state() -> dict[str, float]:
    from phalanx.kernels.gdn_step_triton import gdn_decode_step_fused

    errors = _compare(gdn_decode_step_fused, 20, torch.bfloat16, torch.bfloat16)
    errors["state_after_bf16_stages"] = errors.pop("state")
    return errors


def check_split_bf16_above_threshold() -> dict[str, float]:
    from phalanx.kernels.gdn_step_triton import gdn_decode_step_split

    errors = _compare(gdn_decode_step_split, 20, torch.bfloat16)
    errors["state_after_bf16_stages"] = errors.pop("state")
    return errors


def _repeated(path: str, batch: int, dtype: torch.dtype) -> dict[str, float]:
    """One path against the reference; run twice on equal inputs, it must give equal outputs
    (nothing depends on which program arrives last) and leave its counters at zero."""
    from phalanx.kernels import gdn_step_triton

    step = getattr(gdn_step_triton, f"gdn_decode_step_{path}")
    errors = _compare(step, batch, dtype)
    torch.manual_seed(1)
    first = _step_output(step, batch, dtype)
    torch.manual_seed(1)
    second = _step_output(step, batch, dtype)
    _, arrivals = gdn_step_triton._WORKSPACE.current[torch.device("cpu")]
    errors["repeat_differs"] = float(not all(torch.equal(x, y) for x, y in zip(first, second, strict=True)))
    errors["counters_left"] = float(arrivals.count_nonzero())
    return errors


def _step_output(step: Callable[..., torch.Tensor], batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
    inputs = _step_inputs(batch, dtype)
    names = ["mixed_qkv", "conv_weight", "conv_state", "z", "a", "b", "A_log", "dt_bias", "norm_weight"]
    y = step(*(inputs[n] for n in names), 1e-6, inputs["state"], inputs["state_slots"])
    return [y, inputs["state"], inputs["conv_state"]]


def check_fused_small_fp32() -> dict[str, float]:
    return _repeated("fused", 3, torch.float32)


def check_fused_small_bf16() -> dict[str, float]:
    errors = _repeated("fused", 3, torch.bfloat16)
    errors["state_after_bf16_stages"] = errors.pop("state")
    return errors


def check_fused_bf16_batch_20() -> dict[str, float]:
    errors = _repeated("fused", 20, torch.bfloat16)
    errors["state_after_bf16_stages"] = errors.pop("state")
    return errors


def check_dispatch_takes_split_by_default() -> dict[str, float]:
    from phalanx.kernels import gdn_step_triton

    errors = _dispatched(3, torch.float32, "split", "split")
    default = os.environ.get("PHALANX_GDN") is None
    errors["default_not_split"] = float(default and gdn_step_triton.GDN_PATH != "split")
    return errors


def check_dispatch_takes_fused_when_asked() -> dict[str, float]:
    return _dispatched(3, torch.float32, "fused", "fused")


def check_tuning_bucket_is_the_graph_bucket_capped() -> dict[str, float]:
    from phalanx.kernels.gdn_tiles import MAX_TUNING_ROWS, tuning_bucket

    return {
        "wrong_buckets": float([tuning_bucket(n) for n in (1, 3, 16, 17, 64)] != [1, 4, 16, 32, 64]),
        "uncapped": float(tuning_bucket(256) != MAX_TUNING_ROWS),
    }


def _error_text(fn: Callable[[], None]) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def check_state_layout_errors_name_the_shapes() -> dict[str, float]:
    from phalanx.kernels.gdn_step_triton import check_step_states

    conv_state = torch.zeros(4, CONV_DIM, CONV_K - 1)
    fp16_state = torch.zeros(4, HV, DK, DV, dtype=torch.float16)
    dtype_error = _error_text(lambda: check_step_states(conv_state, fp16_state, CONV_DIM, CONV_K))
    shape_error = _error_text(
        lambda: check_step_states(torch.zeros(4, 8, 3), torch.zeros(4, HV, DK, DV), CONV_DIM, CONV_K)
    )
    return {
        "dtype_text": float(
            not dtype_error.startswith(
                "recurrent state must be contiguous float32 or bfloat16, got torch.float16"
            )
        ),
        "shape_text": float(
            shape_error != f"conv_state must be contiguous [slots, {CONV_DIM}, 3], got (4, 8, 3)"
        ),
    }


def check_bucket_met_in_capture_borrows_nearest_tuned_tile() -> dict[str, float]:
    from phalanx.kernels.gdn_tiles import DEFAULT_TILE, TunedTiles

    rest = (2, 4, 128, 128, torch.bfloat16)
    tuned = TunedTiles("test kernel")
    tuned.tiles.update({(64, *rest): (64, 4), (16, *rest): (32, 2), (32, 9, 9): (8, 1)})
    tune_calls: list[int] = []
    return {
        "equidistant_not_smaller_bucket": float(tuned.for_capture((32, *rest)) != (32, 2)),
        "same_bucket_not_taken": float(tuned.for_capture((64, *rest)) != (64, 4)),
        "other_heads_not_default": float(
            tuned.for_capture((32, 3, 6, 128, 128, torch.bfloat16)) != DEFAULT_TILE
        ),
        "capture_tuned": float(
            tuned.tile((8, *rest), True, lambda: tune_calls.append(8) or (8, 1)) != (32, 2)
            or bool(tune_calls)
        ),
        "eager_not_tuned_and_kept": float(
            tuned.tile((8, *rest), False, lambda: (16, 2)) != (16, 2) or tuned.tiles[(8, *rest)] != (16, 2)
        ),
    }


def check_fixed_bucket_is_never_tuned() -> dict[str, float]:
    from phalanx.kernels.gdn_step_triton import TUNED
    from phalanx.kernels.gdn_tiles import FIXED_TILES, TunedTiles

    rest = (2, 4, 128, 128, torch.bfloat16)
    tuned = TunedTiles("test kernel", {1: (64, 4)})
    tune_calls: list[int] = []
    picked = tuned.tile((1, *rest), False, lambda: tune_calls.append(1) or (8, 1))
    return {
        "fixed_not_taken": float(picked != (64, 4) or tuned.tiles[(1, *rest)] != (64, 4)),
        "fixed_tuned": float(bool(tune_calls)),
        "fixed_in_capture_not_taken": float(tuned.tile((1, 9, 9), True, lambda: (8, 1)) != (64, 4)),
        "other_bucket_not_tuned": float(tuned.tile((2, *rest), False, lambda: (16, 2)) != (16, 2)),
        "step_kernel_batch_1_not_fixed": float(TUNED.fixed.get(1) != FIXED_TILES[1]),
    }


CHECKS: dict[str, Callable[[], dict[str, float]]] = {
    name.removeprefix("check_"): fn for name, fn in list(globals().items()) if name.startswith("check_")
}
# bf16 outputs within bf16 rounding; the fp32 state much tighter; the conv state, the spare slots
# and the dispatch flags exactly (0 = as expected). After bf16 stages the state drifts further
# here than on a GPU: the interpreter rounds to bf16 by truncation, torch to nearest.
TOLERANCE = {"y": 1e-2, "state": 1e-3, "state_after_bf16_stages": 1e-2}
EXACT = 0.0


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=120)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_gdn_step_matches_reference(name: str, interpreted_results: dict[str, dict[str, object]]) -> None:
    assert_within(interpreted_results, name, TOLERANCE, EXACT, measure="error")


def test_tile_prune_keeps_enough_programs_at_small_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 132 SMs and 32 value heads of dv = 128: batch 1 keeps only tiles giving >= 132 programs
    (BV 8 and 16), batch 8 keeps every tile up to dv, and a tiny head count keeps the narrowest."""
    import types

    import triton

    from phalanx.kernels import gdn_tiles

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=132)
    )
    configs = [triton.Config({"BV": bv}, num_warps=w) for bv, w in gdn_tiles.TUNING_SPACE]
    state = types.SimpleNamespace(device=torch.device("cuda", 0))

    def kept(bucket: int, hv: int) -> set[int]:
        named = {"state_ptr": state, "tuning_bucket": bucket}
        return {c.kwargs["BV"] for c in gdn_tiles._prune_configs(configs, named, HV=hv, DV=128)}

    assert kept(1, 32) == {8, 16}
    assert kept(8, 32) == {8, 16, 32, 64, 128}
    assert kept(1, 2) == {8}


def test_unknown_gdn_path_is_refused() -> None:
    stderr = import_error("phalanx.kernels.gdn_step_triton", {"PHALANX_GDN": "both"})
    assert "PHALANX_GDN='both' is not one of split, fused" in stderr


def test_bench_gdn_is_a_bench_kind_and_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from phalanx.tools.bench import cli as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["gdn", "--batch", "1,64", "--paths", "split,fused"])
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the bench would run")
    assert bench.run(args) == 2
    assert "phalanx bench gdn: needs a CUDA GPU" in capsys.readouterr().out


if __name__ == "__main__":
    report(CHECKS)
