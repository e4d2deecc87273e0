"""fla-core's kernels launched without Triton's autotuner and JIT dispatch on every call.

fla-core's chunked forward runs each kernel through ``triton.autotune`` (most also under
``triton.heuristics``): every launch builds the autotuner's key, binds the arguments and walks the
JIT's dispatch, ~100 µs of host time a launch on the GPU host, for ~100 launches a prefill pass
(docs/benchmarks/prefill-h200.md). ``AutotunedLaunch`` stands in for such a kernel in fla-core's
modules (``install``): the first launch of each kind of arguments goes through the autotuner, which
tunes or reads its cached choice, and the chosen config is kept; later launches complete the
arguments as the autotuner and heuristics would (config values, heuristic values, defaults) and
launch the compiled kernel through ``FastLaunch``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from triton.runtime.autotuner import Autotuner, Config, Heuristics

from phalanx.kernels.launch import FastLaunch


class AutotunedLaunch:
    """``kernel[grid](*args, **kwargs)`` for an autotuned kernel (possibly under heuristics)."""

    def __init__(self, kernel: Any) -> None:
        # Heuristics outside the autotuner see the call's arguments; inside, the config's values
        # too. An outer decorator's values reach the inner ones.
        outer: list[tuple[str, Callable[[dict[str, Any]], Any]]] = []
        inner: list[tuple[str, Callable[[dict[str, Any]], Any]]] = []
        autotuner = None
        fn = kernel
        while isinstance(fn, (Autotuner, Heuristics)):
            if isinstance(fn, Heuristics):
                (inner if autotuner is not None else outer).extend(fn.values.items())
            else:
                autotuner = fn
            fn = fn.fn
        if autotuner is None:
            raise TypeError(f"{kernel!r} is not autotuned")
        # the JIT function (an InterpretedFunction under TRITON_INTERPRET=1)
        signature = inspect.signature(fn.fn).parameters.values()
        self.kernel = kernel
        self.autotuner = autotuner
        self.outer, self.inner = outer, inner
        self.names = fn.arg_names
        self.defaults = {p.name: p.default for p in signature if p.default is not inspect.Parameter.empty}
        self.fast = FastLaunch(fn)
        self._configs: dict[tuple, tuple[dict[str, Any], dict[str, Any]]] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self.launch, grid)

    def _key(self, args: dict[str, Any]) -> tuple:
        """What picks the config: the autotuner's key values and every tensor's dtype."""
        tuned = tuple(args.get(name) for name in self.autotuner.keys)
        return tuned + tuple(v.dtype for v in args.values() if isinstance(v, torch.Tensor))

    def launch(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        given = dict(zip(self.names, args, strict=False))
        given.update(kwargs)
        for name, rule in self.outer:  # as Heuristics.run computes them
            given[name] = rule(given)
        key = self._key(given)
        chosen = self._configs.get(key)
        if chosen is None:
            result = self.kernel[grid](*args, **kwargs)
            config: Config = self.autotuner.best_config
            if config.pre_hook is None:  # a config's own hook runs every launch: keep that path
                options = {k: v for k, v in config.all_kwargs().items() if k not in config.kwargs}
                self._configs[key] = (dict(config.kwargs), options)
            return result
        values, options = chosen
        bound = {**given, **values}
        for name, rule in self.inner:
            bound[name] = rule(bound)
        bound = {**self.defaults, **bound}
        self.fast(grid(bound) if callable(grid) else grid, *(bound[name] for name in self.names), **options)
        return None


def install(*modules: ModuleType) -> int:
    """Replaces every autotuned kernel defined at the top level of ``modules`` by an
    ``AutotunedLaunch`` (once); returns how many it replaced."""
    replaced = 0
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, (Autotuner, Heuristics)) and _autotuned(value):
                setattr(module, name, AutotunedLaunch(value))
                replaced += 1
    return replaced


def _autotuned(kernel: Any) -> bool:
    while isinstance(kernel, (Autotuner, Heuristics)):
        if isinstance(kernel, Autotuner):
            return True
        kernel = kernel.fn
    return False
