"""The critical-path attribution of ``phalanx bench decode --profile`` (tools/bench/step_profile.py), on
hand-made kernel timelines: the profiler itself needs a GPU."""

from __future__ import annotations

import pytest

from phalanx.tools.bench.step_profile import attribute, family

# (start us, end us, name): a GEMV, a norm overlapping its tail (PDL), a GDN step that ends inside
# the norm, an idle gap, then a second GEMV.
STEP = [
    (0.0, 10.0, "_gemv_kernel"),
    (5.0, 12.0, "_rms_norm_kernel"),
    (11.0, 11.5, "_step_kernel"),
    (13.0, 20.0, "_gemv_kernel"),
]


def test_each_kernel_is_charged_what_it_adds_to_the_step_end() -> None:
    profile = attribute([STEP, STEP], labels=["in_proj", "out_proj"])
    assert profile.steps == 2
    assert profile.span_us == pytest.approx(40.0)
    assert dict(profile.critical_us) == pytest.approx(
        # the gap 12 -> 13 goes to the kernel the GPU was waiting for
        {"gemv: in_proj": 20.0, "rms norm": 4.0, "gdn step": 0.0, "gemv: out_proj": 16.0}
    )
    assert sum(profile.critical_us.values()) == pytest.approx(profile.span_us)
    assert profile.busy_us["rms norm"] == pytest.approx(14.0)
    table = profile.table("batch 1")
    assert "GPU span 20.0 us a step" in table
    assert "| gemv: in_proj | 1 | 10.0 | 10.00 | 10.0 |" in table


def test_labels_apply_only_when_the_linear_count_matches() -> None:
    profile = attribute([STEP], labels=["in_proj"])
    assert set(profile.critical_us) == {"gemv", "rms norm", "gdn step"}
    assert profile.kernels["gemv"] == 2


@pytest.mark.parametrize(
    "name,expected",
    [
        ("_gemv_kernel", "gemv"),
        ("normed_gemv_kernel", "gemv"),
        ("_skinny_gemm_kernel", "skinny gemm"),
        ("nvjet_tst_128x64_64x6_2x1_v_bz_coopA_TNT", "cuBLAS gemm"),
        ("_conv_decode_kernel", "gdn conv"),
        ("_decode_kernel", "decode attention + merge"),
        ("_norm_rope_write_kv_kernel", "q/k norm + rope + kv write"),
        ("_gated_rms_norm_kernel", "gated rms norm"),
        ("_rms_norm_kernel", "rms norm"),
    ],
)
def test_kernel_families_by_name(name: str, expected: str) -> None:
    assert family(name) == expected
