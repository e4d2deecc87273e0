"""A cheaper way to launch a Triton kernel from Python, for eager decode where launches dominate.

Batch-1 eager decode is host-bound: the GPU finishes each kernel before Python has launched the
next. ``kernel[grid](...)`` goes through Triton's JIT dispatch every time (argument binding,
specialisation key, cache lookup, launch-metadata hooks), which costs more than the compiled
handle's launch (docs/benchmarks/kernel-choices-h200.md). ``FastLaunch`` takes the JIT path once per
specialisation and afterwards calls the compiled kernel's launcher directly.

The cache key mirrors what Triton specialises on: each tensor's dtype and 16-byte alignment,
each integer's ``== 1`` / ``% 16 == 0`` / 32-bit-range class, the exact value of every
``tl.constexpr`` parameter and the launch options. Under ``TRITON_INTERPRET=1`` (CPU tests) there
is no compiled handle and every launch goes through the interpreter.

Programmatic dependent launch (PDL, compute capability 9 and later): the decode kernels call
``wait_for_producer`` and are launched with ``launch_pdl``, so the GPU may start one while the
kernel before it drains. Inside a CUDA graph that hides the gap between dependent kernels
(``docs/benchmarks/kernel-choices-h200.md``). What a kernel may read before its wait:

- weights (they never change): the batch-1 GEMVs request their first weight tile there;
- anything written two or more launches back. A kernel starts only once every program of the
  kernel before it has passed its own wait, so everything before that one has finished and its
  writes are visible. (A kernel launched without PDL, such as cuBLAS or NCCL, lets the next one
  start only when it ends.) The pre-normed linears read the residual stream there: a decoder's
  previous pre-norm wrote it, and at least one linear runs between the two.

Reads of the kernel just before's outputs, and every store, come after the wait, so each kernel
sees its inputs whole and never overwrites what the kernel before it may still read. Requests into
L2 (``prefetch_l2``) are neither reads nor stores of values and may target anything.
``PHALANX_PDL=0`` turns PDL off.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phalanx.config import settings

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INT32 = 1 << 31
_Tensor = torch.Tensor


@functools.cache
def pdl_enabled() -> bool:
    """Whether decode kernels launch with PDL: on a CUDA GPU of compute capability 9 or later, not
    under the interpreter, unless ``PHALANX_PDL=0``. Asked at launch time only (it reads the GPU)."""
    if _INTERPRET or not settings.pdl_allowed():
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    """Under PDL: block until the kernel before this one has finished and its writes are visible,
    then let the next kernel start launching. Call before any read of a previous kernel's output
    and before any store, in every program."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Requests the 128-byte lines of ``ptrs`` (where ``mask``) into L2 and moves on: no registers
    wait for them. CUDA only (inline PTX; never under the interpreter)."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r",
        args=[ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def _spec(arg: Any) -> Any:
    """What Triton specialises a runtime argument on (the key is built on every launch: keep it lean)."""
    cls = arg.__class__
    if cls is _Tensor or isinstance(arg, _Tensor):
        return arg.dtype, not arg.data_ptr() & 15
    if cls is int:
        return arg if arg == 1 else (not arg & 15, -_INT32 <= arg < _INT32)
    return cls if cls is float else arg


@functools.cache
def sm_count(device: torch.device) -> int:
    """The multiprocessor count of a CUDA device (read once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` without its wrapper's call overhead (~5 µs, on every launch)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fast_key_function(args: tuple, count: int) -> Callable[[tuple], tuple]:
    """A key function specialised to the argument kinds of ``args`` (the first launch's): the same
    information as ``_spec`` per argument, as one generated expression instead of a call per
    argument (half the host time of a 20-argument launch). A later launch whose arguments are of
    other kinds makes it raise (AttributeError, KeyError or TypeError), and the launch then takes
    the general key, so a kind change can never reuse a binary built for another."""
    parts = []
    for i, arg in enumerate(args[:count]):
        a = f"a[{i}]"
        if isinstance(arg, _Tensor):
            parts.append(f"{a}.dtype, not {a}.data_ptr() & 15")
        elif arg.__class__ is int:
            parts.append(f"_INT[{a}.__class__], {a} == 1, not {a} & 15, {-_INT32} <= {a} < {_INT32}")
        elif arg.__class__ is float:
            parts.append(f"_FLOAT[{a}.__class__]")
        elif arg is None:  # an optional tensor left out: a tensor there later is another kind
            parts.append(f"_NONE[{a}.__class__]")
        else:
            parts.append(a)
    source = f"lambda a: ({', '.join(parts)}, *a[{count}:])"
    kinds = {"_INT": {int: int}, "_FLOAT": {float: float}, "_NONE": {type(None): None}}
    return eval(source, kinds)  # noqa: S307 (our own text)


_KIND_CHANGED = (AttributeError, KeyError, TypeError)


class FastLaunch:
    """Wraps one ``@triton.jit`` kernel. Call with the grid, every kernel parameter in order
    (constexprs too, as plain values) and the launch options (``num_warps``...). With ``pdl``, the
    kernel's last parameter is ``USE_PDL: tl.constexpr`` (it calls ``wait_for_producer``): the
    launch supplies it and ``launch_pdl`` from ``pdl_enabled()``."""

    def __init__(self, kernel: Any, pdl: bool = False) -> None:
        self.kernel = kernel
        self.pdl = pdl
        params = getattr(kernel, "params", ())
        self._constexpr = frozenset(p.num for p in params if p.is_constexpr)
        # Kernels declare their constexprs last; then the key splits the arguments instead of
        # testing every position.
        first = min(self._constexpr, default=len(params))
        self._runtime_count = first if self._constexpr == set(range(first, len(params))) else None
        self._fast_key: Callable[[tuple], tuple] | None = None
        self._compiled: dict[tuple, Any] = {}

    def _key(self, args: tuple, options: dict[str, Any]) -> tuple:
        count = self._runtime_count
        if count is not None:
            return (*map(_spec, args[:count]), *args[count:], *options.values())
        constexpr = self._constexpr
        return (*[a if i in constexpr else _spec(a) for i, a in enumerate(args)], *options.values())

    def _launch_key(self, args: tuple, options: dict[str, Any]) -> tuple:
        fast_key = self._fast_key
        if fast_key is None:
            if self._runtime_count is None:
                return self._key(args, options)
            fast_key = self._fast_key = _fast_key_function(args, self._runtime_count)
        try:
            return (True, fast_key(args), *options.values())
        except _KIND_CHANGED:
            return (False, *self._key(args, options))

    def _with_pdl(self, args: tuple, options: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if self.pdl:
            use_pdl = pdl_enabled()
            args = (*args, use_pdl)
            options["launch_pdl"] = use_pdl
        return args, options

    def __call__(self, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
        args, options = self._with_pdl(args, options)
        if _INTERPRET:
            self.kernel[grid](*args, **options)
            return
        key = self._launch_key(args, options)
        compiled = self._compiled.get(key)
        if compiled is None:
            # The JIT path compiles (or finds) this specialisation and launches it.
            self._compiled[key] = self.kernel[grid](*args, **options)
            return
        # Looked up per launch, not at import: importing must work on a machine without a GPU.
        driver = triton.runtime.driver.active
        stream = driver.get_current_stream(driver.get_current_device())
        gx, gy, gz = (*grid, 1, 1)[:3]
        # No launch hooks are installed, so no launch metadata is built for them.
        compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    def bind(
        self, grid: tuple[int, ...], args: tuple, per_call: Sequence[_Tensor], **options: Any
    ) -> Callable[..., None]:
        """This launch with its grid, options and every argument but the ``per_call`` tensors
        fixed: the returned function takes tensors in the order of ``per_call`` and launches with
        each one where its counterpart stands in ``args`` (by identity; one tensor may stand in
        several places). It skips the key and the lookup of ``__call__``, and calls the compiled
        handle with the arguments already in place: an op bound to its weights and shapes
        (``kernels/bound.py``) launches through it.

        The binary is the one ``args`` specialise to, which must have been launched before (else,
        and under the interpreter, every launch takes ``__call__``). A per-call tensor whose dtype
        or 16-byte alignment differs from its counterpart's would need another binary: that launch
        takes ``__call__`` too, so a binding never runs a binary built for other arguments."""
        slots = {i: j for i, arg in enumerate(args) for j, t in enumerate(per_call) if arg is t}
        names = [f"t{j}" for j in range(len(per_call))]
        full_args, full_options = self._with_pdl(args, dict(options))
        compiled = None if _INTERPRET else self._compiled.get(self._launch_key(full_args, full_options))
        # The binding keeps no per-call tensor alive: their places hold None.
        fixed = [None if i in slots else a for i, a in enumerate(args)]

        def general(*tensors: _Tensor) -> None:
            self(grid, *[tensors[slots[i]] if i in slots else a for i, a in enumerate(fixed)], **options)

        if compiled is None or not per_call:
            return general
        aligned = [n for n, t in zip(names, per_call, strict=True) if not t.data_ptr() & 15]
        guard = [f"{n}.dtype is d[{j}]" for j, n in enumerate(names)]
        if aligned:
            guard.append(f"not ({' | '.join(f'{n}.data_ptr()' for n in aligned)}) & 15")
        call_args = [names[slots[i]] if i in slots else f"c[{i}]" for i in range(len(full_args))]
        gx, gy, gz = (*grid, 1, 1)[:3]
        source = (
            f"lambda {', '.join(names)}: run({gx}, {gy}, {gz}, stream(device()), fn, meta, None, None, None, "
            f"{', '.join(call_args)}) if {' and '.join(guard)} else general({', '.join(names)})"
        )
        driver = triton.runtime.driver.active
        namespace = {
            "run": compiled.run,
            "stream": driver.get_current_stream,
            "device": driver.get_current_device,
            "fn": compiled.function,
            "meta": compiled.packed_metadata,
            "c": [None if i in slots else a for i, a in enumerate(full_args)],
            "d": [t.dtype for t in per_call],
            "general": general,
        }
        return eval(source, namespace)  # noqa: S307 (our own text)
