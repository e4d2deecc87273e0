"""Compile an autotuned kernel's candidate configs side by side, in worker processes.

On a machine whose Triton cache is empty, the pre-capture sweep's time is compile time: every
tuning key of a decode step is benchmarked over every candidate config, and Triton compiles each
candidate when the autotuner first runs it, one after another, on one core (the 4B sweep compiles
~100 binaries at ~0.5 s each; compiling on threads gained only 1.3x, as most of it holds the GIL).

Inside ``parallel_compile()``, an autotuned kernel built with ``precompiling(...)`` as its early
prune hook does this for a new tuning key before the autotuner benchmarks it:

1. Each candidate config goes through Triton's own binder once, in warm-up mode, with a
   ``jit_cache_hook`` that records the specialisation Triton would compile and skips compiling.
   So the arguments' dtypes, alignments and integer classes are Triton's, not a copy of its rules.
2. Specialisations whose binary is already in Triton's cache (the same key ``triton.compile``
   computes) are dropped; the rest compile at once into the cache, one per worker process, while
   this process takes jobs from the same queue (the workers need seconds to start). The workers
   are plain subprocesses (``python -m kernels.parallel_compile``), as decode ranks are daemonic
   processes, which multiprocessing does not let have children.
3. The autotuner then benchmarks as before; each config it runs is now a cache hit.

The workers start on the first compile the block needs (a warm cache starts none) and are gone
when the block exits. Any failure here (a worker that dies, a config that fails to compile)
is logged and left to the autotuner, which compiles that config itself and reports errors as it
always has. ``PHALANX_COMPILE_WORKERS`` sets the worker count (0 turns this off); by default each
rank on a host gets an equal share of its cores, at most 16.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import triton

from phalanx.config import settings

log = structlog.get_logger(__name__)

_MAX_WORKERS = 16
_ROUND_TIMEOUT_S = 300.0  # one key's configs; the sweep's own watchdog (600 s) still governs
_START_POLL_S = 0.05  # how often a round's feeder of a starting worker looks whether jobs are left
_STARTED = "started"  # a worker's first message: its modules are imported
_Prune = Callable[..., list[triton.Config]]


def default_workers(ranks_here: int) -> int:
    """Compile workers for one rank: ``PHALANX_COMPILE_WORKERS``, else its share of the cores."""
    configured = settings.compile_workers()
    if configured is not None:
        return configured
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, cores // max(1, ranks_here)))


class _Worker:
    """One compile process: ``python -m kernels.parallel_compile``, fed pickled jobs on its stdin,
    answering each on its stdout. A plain subprocess, not multiprocessing: decode ranks are daemonic
    processes, which multiprocessing forbids to have children, and a subprocess never re-runs the
    parent's main script. It exits when its stdin closes, so a rank that dies takes it along."""

    def __init__(self, preload: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        # Set once the worker has imported its modules and can take jobs (failed says if it died).
        self.started = threading.Event()
        self.failed: str | None = None
        threading.Thread(target=self._await_start, daemon=True).start()

    def _await_start(self) -> None:
        try:
            if pickle.load(self.process.stdout) != _STARTED:
                self.failed = "compile worker sent something else than its start"
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self.failed = f"compile worker exited while starting: {exc!r}"
        self.started.set()

    def run(self, job: tuple[Any, ...]) -> str | None:
        """The job's error (None when it compiled). Raises EOFError or OSError if the worker died."""
        pickle.dump(job, self.process.stdin)
        self.process.stdin.flush()
        return pickle.load(self.process.stdout)

    def close_input(self) -> None:
        """Tells the worker to exit (it exits when its stdin closes)."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()

    def wait(self) -> None:
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _CompilePool:
    """The worker processes of one ``parallel_compile`` block, started on first use."""

    def __init__(self, workers: int, compile_here: bool = True) -> None:
        self.workers = workers
        self.compile_here = compile_here
        self._live: list[_Worker] = []
        self.broken = False
        self.compiled = 0
        self.compiled_here = 0  # of ``compiled``, by this process itself
        self.rounds = 0
        self.seconds = 0.0

    def compile(self, kernel: Any, specs: list[str], target: Any) -> None:
        module, qualname = kernel.fn.__module__, kernel.fn.__qualname__
        started = time.perf_counter()
        if not self._live:
            # All at once: each starts (and imports the kernel's module) side by side.
            self._live = [_Worker(preload=module) for _ in range(self.workers)]
        jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        for spec in specs:
            jobs.put((module, qualname, spec, target))
        compiled: list[None] = []
        errors: list[str] = []
        feeders = [
            threading.Thread(target=self._feed, args=(w, jobs, compiled, errors), daemon=True)
            for w in self._live
        ]
        for feeder in feeders:
            feeder.start()
        if self.compile_here:
            # This process takes jobs too: on the H200 host a new worker needed ~6 s to import
            # torch and Triton, which made the first round of a cold sweep 7 s for 5 binaries.
            here = self._compile_here(jobs, errors)
            compiled.extend([None] * here)
            self.compiled_here += here
        deadline = time.monotonic() + _ROUND_TIMEOUT_S
        for feeder in feeders:
            feeder.join(max(0.0, deadline - time.monotonic()))
        stuck = [w for w, f in zip(self._live, feeders, strict=True) if f.is_alive()]
        for worker in stuck:  # its feeder then sees the pipe close and returns
            worker.process.kill()
        self._live = [w for w in self._live if w.process.poll() is None]
        self.broken = not self._live
        if errors or stuck:
            # The autotuner compiles whatever is missing itself.
            log.warning(
                "parallel compile round incomplete; the autotuner compiles the rest itself",
                kernel=qualname,
                timed_out=len(stuck),
                failed=len(errors),
                first_error=errors[0] if errors else None,
            )
        self.compiled += len(compiled)
        self.rounds += 1
        self.seconds += time.perf_counter() - started

    @staticmethod
    def _compile_here(jobs: queue.SimpleQueue, errors: list[str]) -> int:
        """Runs jobs in this process until none are left; how many compiled."""
        done = 0
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return done
            error = _run_job(job)
            if error is None:
                done += 1
            else:
                errors.append(error)

    @staticmethod
    def _feed(worker: _Worker, jobs: queue.SimpleQueue, compiled: list[None], errors: list[str]) -> None:
        """Runs jobs on one worker until none are left or the worker dies. A worker still starting
        takes none until it has started, and none at all if the others empty the queue first."""
        while not worker.started.wait(_START_POLL_S):
            if jobs.empty():
                return
        if worker.failed is not None:
            errors.append(worker.failed)
            return
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                error = worker.run(job)
            except (EOFError, OSError, pickle.UnpicklingError) as exc:
                errors.append(f"compile worker exited: {exc!r}")
                return
            if error is None:
                compiled.append(None)
            else:
                errors.append(error)

    def close(self) -> None:
        # All told first, then waited for: each takes ~0.4 s to exit (interpreter teardown), which
        # one after another cost the H200's cold sweep 6.7 s with 16 workers.
        for worker in self._live:
            worker.close_input()
        for worker in self._live:
            worker.wait()
        self._live = []


_active: _CompilePool | None = None


@contextlib.contextmanager
def parallel_compile(ranks_here: int = 1) -> Iterator[_CompilePool | None]:
    """Within this block, ``precompiling`` autotuners compile a new key's configs in parallel.
    Yields the block's pool (its counters), or None where compiling stays serial: no workers,
    the interpreter, or inside another such block."""
    global _active
    workers = default_workers(ranks_here)
    if workers == 0 or _active is not None or os.environ.get("TRITON_INTERPRET") == "1":
        yield None
        return
    _active = pool = _CompilePool(workers)
    try:
        yield pool
    finally:
        _active = None
        pool.close()
        if pool.rounds:
            log.info(
                "parallel compile done",
                workers=workers,
                binaries=pool.compiled,
                in_this_process=pool.compiled_here,
                rounds=pool.rounds,
                seconds=round(pool.seconds, 2),
            )


def precompiling(kernel: Any, prune: _Prune | None = None) -> _Prune:
    """An ``early_config_prune`` hook for ``triton.autotune`` over ``kernel`` (the ``@triton.jit``
    function): ``prune``'s configs (all of them without one), compiled in parallel first when
    inside ``parallel_compile()``."""

    def early_config_prune(
        configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
    ) -> list[triton.Config]:
        if prune is not None:
            configs = prune(configs, named_args, **kwargs)
        pool = _active
        if pool is not None and not pool.broken:
            _precompile(pool, kernel, configs, named_args, kwargs)
        return configs

    return early_config_prune


def _precompile(
    pool: _CompilePool, kernel: Any, configs: list[triton.Config], named_args: dict[str, Any], kwargs: dict
) -> None:
    target = triton.runtime.driver.active.get_current_target()
    missing = [
        spec
        for spec in specializations(kernel, configs, named_args, kwargs)
        if not is_cached(kernel, spec, target)
    ]
    if missing:
        pool.compile(kernel, missing, target)


def specializations(
    kernel: Any, configs: list[triton.Config], named_args: dict[str, Any], kwargs: dict[str, Any]
) -> list[str]:
    """Triton's serialized specialisation of each config not yet compiled in this process, as its
    binder makes it for these arguments (nothing is compiled or launched)."""
    from triton import knobs

    specs: list[str] = []

    def record(**hook: Any) -> bool:
        specs.append(hook["compile"]["specialization_data"])
        return True  # skip the compile: the workers do it

    args = [named_args[name] for name in kernel.arg_names if name in named_args]
    call_kwargs = {name: value for name, value in kwargs.items() if name not in ("grid", "warmup")}
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        for config in configs:
            kernel.run(*args, grid=None, warmup=True, **call_kwargs, **config.all_kwargs())
    finally:
        knobs.runtime.jit_cache_hook = previous
    return specs


def _source(kernel: Any, spec: str, target: Any) -> tuple[Any, Any, Any]:
    """(source, backend, options) of a serialized specialisation, as ``JITFunction.preload``
    rebuilds them, for ``target`` instead of the current device's (no GPU needed)."""
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    data = json.loads(spec)

    def constant(value: Any) -> Any:
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(convert_to_tuple_if_list(value["constexpr"]))
        return convert_to_tuple_if_list(value)

    constexprs = {
        tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)
    }
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True)}
    signature = {name: convert_to_tuple_if_list(ty) for name, ty in data["signature"].items()}
    backend = make_backend(target)
    options = backend.parse_options(
        {name: tuple(v) if isinstance(v, list) else v for name, v in data["options"].items()}
    )
    return ASTSource(kernel, signature, constexprs, attrs), backend, options


def is_cached(kernel: Any, spec: str, target: Any) -> bool:
    """Whether ``triton.compile`` would find this specialisation's binary in the cache: the same
    key and file it looks up."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key, get_cache_manager

    src, backend, options = _source(kernel, spec, target)
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
    metadata_file = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(metadata_file)
    return bool(group) and metadata_file in group


def _jit_function(module: str, qualname: str) -> Any:
    obj = getattr(importlib.import_module(module), qualname)
    while not isinstance(obj, triton.runtime.JITFunction):
        obj = obj.fn  # an autotuner or heuristics wrapper bound under the kernel's own name
    return obj


def _compile_job(module: str, qualname: str, spec: str, target: Any) -> None:
    """In a worker process: compile one specialisation into Triton's cache."""
    kernel = _jit_function(module, qualname)
    src, _, options = _source(kernel, spec, target)
    triton.compile(src, target=target, options=options.__dict__)


def _run_job(job: tuple[Any, ...]) -> str | None:
    """Compiles one job; its error, or None. An error leaves that config to the autotuner."""
    try:
        _compile_job(*job)
    except Exception as exc:
        return f"{job[1]}: {exc!r}"
    return None


def _worker_main(preload: str) -> None:
    """A compile worker's loop: a pickled job in, its error (or None) out, until stdin closes."""
    # Answers go out on a private copy of stdout; file descriptor 1 itself then points at stderr,
    # so nothing a compile prints (Python or native code) can corrupt them.
    jobs, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    importlib.import_module(preload)
    pickle.dump(_STARTED, answers)
    answers.flush()
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        pickle.dump(_run_job(job), answers)
        answers.flush()


if __name__ == "__main__":
    _worker_main(sys.argv[1])
