"""``phalanx bench host`` on the CPU with the tiny geometry: every decode op gets a row, and the
timers come off ``kernels.ops`` afterwards."""

from __future__ import annotations

import argparse

import pytest

from phalanx.kernels import ops
from phalanx.tools.bench import host as bench_host


def test_host_bench_times_every_decode_op_and_restores_ops(capsys: pytest.CaptureFixture[str]) -> None:
    before = {name: getattr(ops, name) for name in ops.__all__}
    parser = argparse.ArgumentParser()
    bench_host.add_arguments(parser)
    assert bench_host.run(parser.parse_args(["--geometry", "tiny", "--device", "cpu", "--steps", "2"])) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    ops_seen = ("linear", "rms_norm_linear", "rms_norm_linear_silu_and_mul", "rms_norm", "gdn_decode_step")
    for op in (*ops_seen, "paged_decode_attention"):
        assert op in rows, f"no row for {op}:\n{out}"
    # The tiny geometry: 4 layers (3 linear attention, 1 full); each layer's two norms run inside
    # its first linears, so only the final norm is a norm of its own.
    assert rows["rms_norm_linear"].split("|")[2].strip() == "4"
    assert rows["rms_norm_linear_silu_and_mul"].split("|")[2].strip() == "4"
    assert rows["rms_norm"].split("|")[2].strip() == "1"
    assert "(model glue: views, splits, allocations)" in rows
    assert any(
        line.startswith("host: ") and " cores; torch.empty on cpu " in line for line in out.splitlines()
    )
    assert {name: getattr(ops, name) for name in ops.__all__} == before
