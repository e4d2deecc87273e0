"""``AutotunedLaunch`` (``kernels/fla_launch.py``) on CPU under ``TRITON_INTERPRET=1``: an
autotuned kernel under heuristics, with a constexpr default and a grid that reads the config,
gives the same outputs through the autotuner's first launch of each kind of arguments and through
the kept config's direct launch after it. fla-core's own kernels run on the GPU only
(``tests/cuda/test_cuda_gdn_prefill.py``).

As in ``test_kernels_triton.py`` the checks run in one child process (this file run as a script).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton
import triton.language as tl

from tests.support.interpreter_checks import assert_within, report, run_interpreted


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
    key=["n"],
    do_bench=lambda kernel_call, quantiles: (kernel_call(), [1.0, 1.0, 1.0])[1],  # no GPU timer here
)
@triton.jit
def _scale_kernel(
    x, bias, out, n, scale, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 3
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    v = tl.load(x + i, mask=mask) * scale + SHIFT
    if HAS_BIAS:
        v += tl.load(bias + i, mask=mask)
    tl.store(out + i, v, mask=mask)


@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
    key=["n"],
    do_bench=lambda kernel_call, quantiles: (kernel_call(), [1.0, 1.0, 1.0])[1],
)
@triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})  # reads the config's value
@triton.jit
def _double_kernel(x, out, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i) if EVEN else tl.load(x + i, mask=i < n, other=0.0)
    tl.store(out + i, v * 2, mask=i < n)


def check_heuristics_inside_the_autotuner() -> dict[str, float]:
    from phalanx.kernels.fla_launch import AutotunedLaunch

    launch = AutotunedLaunch(_double_kernel)
    errors = {}
    for index, n in enumerate([64, 50, 64, 50]):
        if index == 2:
            launch.kernel = None  # from here on only the kept configs may launch
        x, out = torch.randn(n), torch.full((n,), float("nan"))
        launch[lambda meta, n=n: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
        errors[f"call{index}_n{n}"] = float((out - 2 * x).abs().max())
    return errors


def check_autotuned_launch() -> dict[str, float]:
    from phalanx.kernels.fla_launch import AutotunedLaunch

    launch = AutotunedLaunch(_scale_kernel)
    errors = {}
    calls = [(50, True), (50, False), (70, True), (50, True), (50, False), (70, True)]
    for index, (n, with_bias) in enumerate(calls):
        if index == 3:
            launch.kernel = None  # every kind seen: from here on only the kept configs may launch
        x, bias, out = torch.randn(n), torch.randn(n) if with_bias else None, torch.full((n,), float("nan"))
        launch[lambda meta, n=n: (triton.cdiv(n, meta["BLOCK"]),)](x, bias, out, n, 2.0)
        expected = x * 2.0 + 3 + (bias if with_bias else 0)
        errors[f"call{index}_n{n}_bias{with_bias}"] = float((out - expected).abs().max())
    errors["kinds_kept_not_3"] = float(len(launch._configs) != 3)
    return errors


CHECKS: dict[str, Callable[[], dict[str, float]]] = {
    name.removeprefix("check_"): fn for name, fn in list(globals().items()) if name.startswith("check_")
}


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=120)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_autotuned_launch_matches_the_autotuners(
    name: str, interpreted_results: dict[str, dict[str, object]]
) -> None:
    assert_within(interpreted_results, name, {}, 1e-5, measure="absolute error")


if __name__ == "__main__":
    report(CHECKS)
