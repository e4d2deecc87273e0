"""kernels/parallel_compile.py on the CPU: worker processes compile (for an sm_90 target, no GPU
needed) exactly the binary Triton's own compile would look up, and a failing job never raises."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

from phalanx.kernels.parallel_compile import _CompilePool, default_workers, is_cached
from tests.support.compile_probe import scale_kernel

TARGET = GPUTarget("cuda", 90, 32)
ROOT = Path(__file__).resolve().parents[2]


def _spec(block: int, warps: int) -> str:
    """A specialisation as Triton's binder serializes it: 16-byte aligned pointers, i32 n."""
    options = make_backend(TARGET).parse_options({"num_warps": warps})
    return json.dumps(
        {
            "name": "compile_probe.scale_kernel",
            "signature": {
                "x_ptr": "*fp32",
                "y_ptr": "*fp32",
                "n": "i32",
                "factor": "fp32",
                "BLOCK": "constexpr",
            },
            "constant_keys": [[4]],
            "constant_vals": [block],
            "attrs_keys": [[0], [1]],
            "attrs_vals": [[["tt.divisibility", 16]], [["tt.divisibility", 16]]],
            "options": options.__dict__,
            "key": "probe",
        }
    )


def test_workers_fill_the_cache_that_compile_reads(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    specs = [_spec(64, 4), _spec(128, 4), _spec(128, 8)]
    assert not any(is_cached(scale_kernel, spec, TARGET) for spec in specs)
    pool = _CompilePool(workers=2, compile_here=False)
    try:
        pool.compile(scale_kernel, specs, TARGET)
    finally:
        pool.close()
    assert pool.compiled == 3 and not pool.broken
    assert all(is_cached(scale_kernel, spec, TARGET) for spec in specs)
    # Another block size is another binary, still missing.
    assert not is_cached(scale_kernel, _spec(256, 4), TARGET)


def test_a_failing_compile_is_logged_not_raised(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bad = json.loads(_spec(64, 4))
    bad["signature"]["x_ptr"] = "*nosuchtype"
    pool = _CompilePool(workers=1, compile_here=False)
    try:
        pool.compile(scale_kernel, [json.dumps(bad), _spec(64, 4)], TARGET)
    finally:
        pool.close()
    assert pool.compiled == 1
    assert is_cached(scale_kernel, _spec(64, 4), TARGET)


def test_this_process_compiles_beside_starting_workers(tmp_path, monkeypatch) -> None:
    """While its one worker still starts (imports torch and Triton), the calling process takes the
    round's other jobs itself; all land in the cache, counted once, one bad job logged."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bad = json.loads(_spec(64, 4))
    bad["signature"]["x_ptr"] = "*nosuchtype"
    specs = [_spec(64, 4), _spec(128, 4), _spec(128, 8), json.dumps(bad)]
    pool = _CompilePool(workers=1)
    try:
        pool.compile(scale_kernel, specs, TARGET)
    finally:
        pool.close()
    assert pool.compiled == 3 and 1 <= pool.compiled_here <= 3 and not pool.broken
    assert all(is_cached(scale_kernel, spec, TARGET) for spec in specs[:3])


def test_worker_count(monkeypatch) -> None:
    monkeypatch.setenv("PHALANX_COMPILE_WORKERS", "3")
    assert default_workers(ranks_here=8) == 3
    monkeypatch.setenv("PHALANX_COMPILE_WORKERS", "-1")
    with pytest.raises(ValueError, match="PHALANX_COMPILE_WORKERS='-1' is not a whole number of 0 or more"):
        default_workers(ranks_here=1)
    monkeypatch.delenv("PHALANX_COMPILE_WORKERS")
    assert 1 <= default_workers(ranks_here=1000) <= default_workers(ranks_here=1) <= 16


def test_workers_do_not_rerun_an_unguarded_main_script(tmp_path) -> None:
    """Spawned workers must not re-run the parent's main script: here one with no __name__ guard,
    which would start the pool again in each worker and break it."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path[:0] = {[str(ROOT)]!r}
            from tests.support.compile_probe import scale_kernel
            from tests.kernels.test_parallel_compile import TARGET, _spec
            from phalanx.kernels.parallel_compile import _CompilePool
            pool = _CompilePool(workers=2, compile_here=False)
            pool.compile(scale_kernel, [_spec(64, 4), _spec(64, 8)], TARGET)
            pool.close()
            print("compiled", pool.compiled, "broken", pool.broken)
            """
        )
    )
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "compiled 2 broken False", done.stdout + done.stderr[-2000:]


def _compile_in_this_process(cache_dir: str, answers: multiprocessing.Queue) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    pool = _CompilePool(workers=2, compile_here=False)
    try:
        pool.compile(scale_kernel, [_spec(64, 4), _spec(32, 4)], TARGET)
    finally:
        pool.close()
    answers.put((pool.compiled, pool.broken))


def test_a_daemonic_rank_process_can_compile_in_workers(tmp_path) -> None:
    """Decode ranks are daemonic processes (executor/launcher.py), which multiprocessing forbids to
    have children: the workers must still start there."""
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    rank = context.Process(target=_compile_in_this_process, args=(str(tmp_path), answers), daemon=True)
    rank.start()
    try:
        assert answers.get(timeout=120) == (2, False)
    finally:
        rank.join(timeout=30)
