"""kernels/parallel_compile.py on the GPU: an autotuner's configs compile in worker processes, and
Triton's own compile in this process then finds every one of them in the cache."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.testing
from triton import knobs

from phalanx.kernels.parallel_compile import parallel_compile, precompiling
from tests.support.compile_probe import scale_kernel

pytestmark = pytest.mark.cuda


def _quick_bench(fn, quantiles):
    return triton.testing.do_bench(fn, warmup=1, rep=2, quantiles=quantiles)


def test_configs_compile_in_workers_and_the_jit_hits_the_cache(tmp_path, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PHALANX_COMPILE_WORKERS", "3")
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 4), (128, 4), (256, 8))]
    tuned = triton.autotune(
        configs,
        key=["n"],
        prune_configs_by={"early_config_prune": precompiling(scale_kernel)},
        do_bench=_quick_bench,
    )(scale_kernel)
    cache_hits: list[bool] = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **event: cache_hits.append(event["cache_hit"]))
    x = torch.randn(3100, device="cuda")
    y = torch.empty_like(x)
    with parallel_compile() as pool:
        tuned[lambda meta: (triton.cdiv(3000, meta["BLOCK"]),)](x, y, 3000, 2.0)
        assert pool is not None and not pool.broken
        assert (pool.compiled, pool.rounds) == (3, 1)
    torch.testing.assert_close(y[:3000], x[:3000] * 2.0)
    # This process takes jobs too while the workers start: each of its compiles is a miss (the
    # workers' compiles happen in their processes). Then the autotuner's three are all hits.
    assert cache_hits == [False] * pool.compiled_here + [True, True, True]
    # A second key of the same binaries (n differs, its class does not) compiles nothing new.
    with parallel_compile() as pool:
        tuned[lambda meta: (triton.cdiv(3016, meta["BLOCK"]),)](x, y, 3016, 3.0)
        assert pool is not None and pool.rounds == 0
    torch.testing.assert_close(y[:3016], x[:3016] * 3.0)
