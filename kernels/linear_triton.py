"""Triton skinny linears for decode: ``y = x @ w.T`` with small M, same contract as ``kernels/linear.py``.

Batch-1 decode is bound by reading the weights once, so the kernels are built for bandwidth:

- **GEMV** (M = 1): ``kernels/linear_gemv_triton.py``, plain and pre-normed.
- **Skinny GEMM** (M >= 2): ``tl.dot`` with the operands swapped (``y.T = w @ x.T``), so the weight
  tile fills the MMA's wide M side (16..128 rows) and the batch (16/32/64, padded) its narrow N
  side; loads are pipelined through shared memory (cp.async). A broadcast GEMV for M = 2..8 is
  slower: the [M, N, K] product forces a shared-memory layout conversion with four
  barriers per K step (seen in the sm_90 PTX), while the MMA path pays only for padded FLOPs, which
  a bandwidth-bound decode has to spare.
- ``*_silu_and_mul``: the MLP's gate_up weight ``[2I, K]``; each program reads gate rows ``j`` and
  the matching up rows ``j + I`` and writes ``silu(gate) * up``: one launch, no ``[M, 2I]`` round trip.
- ``rms_norm_linear*``: at M = 1 (and K up to ``NORMED_MAX_K``), the decoder's pre-norm (residual
  add, then (1 + w) RMSNorm) in the pre-normed GEMV's prologue, which removes the 64 norm launches
  of a 4B batch-1 decode step. More rows, or wider ones, run the norm kernel and then the GEMM or
  the plain GEMV (see ``_pre_normed``).

Triton or cuBLAS, per shape: right after a tuning key is tuned (eagerly), its tuned kernel races
cuBLAS (with the separate norm and SiLU kernels where the Triton op fuses them) on the same inputs
(``kernels/linear_race.py``); from then on the key answers from the faster one
(``PHALANX_LINEAR=triton`` skips the race). On the H200 the GEMV beats cuBLAS at M = 1
(docs/benchmarks/kernel-choices-h200.md), while at M = 64 cuBLAS wins the N = 2560 projections, where
the skinny GEMM has only N / BLOCK_N programs: shapes where cuBLAS wins are what the race catches.

The skinny GEMM may split K on thin shapes (``kernels/linear_split_k.py``: one launch, the last
split to arrive sums them); the autotuner decides per key whether a split config is faster. It won
the N = 2560 projections at M = 16 and 32 on the H200; at M = 64 cuBLAS still wins them.

Autotuning and CUDA graphs: each GEMV is tuned per (N, K, fused or not), the
GEMM per (N, K, ``BLOCK_M``, fused or not), where ``BLOCK_M`` is the power-of-2 bucket of M clamped to 16..64, never
M itself. Decode graph buckets are powers of 2 (protocol/buckets.py), and the graph sweep's Warmup
phase runs one eager decode step per bucket with exactly the bucket's row count before any Capture
(worker/graphs.py), so every tuning key a captured graph uses has been tuned eagerly first and
capture never benchmarks. A key first met inside a capture is refused with a clear error rather than
benchmarked there. After its first (tuning) launch, a key's pick is launched through
``kernels/launch.py``'s compiled handle (``_run``). Under ``TRITON_INTERPRET=1`` (CPU tests)
autotuning is bypassed with one small fixed config, and ``tl.dot`` operands are upcast to fp32
because the interpreter computes bf16 dot products wrongly.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from phalanx.kernels import linear_gemv_triton
from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, pdl_enabled, wait_for_producer
from phalanx.kernels.linear import check_out
from phalanx.kernels.linear_gemv_triton import (
    GEMV_CONFIGS,
    NORMED_GEMV_CONFIGS,
    gemv_grid,
    gemv_kernel,
    normed_gemv_kernel,
    prune_normed_configs,
)
from phalanx.kernels.linear_race import cublas_beats_triton
from phalanx.kernels.linear_split_k import (
    MAX_SPLIT_K,
    no_workspace,
    prune_split_configs,
    split_k_allowed,
    split_k_workspace,
    sum_split_partials,
)
from phalanx.kernels.parallel_compile import precompiling

log = structlog.get_logger(__name__)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DOT_MIN_M = 16  # tl.dot needs every block dimension >= 16
_DOT_MAX_BLOCK_M = 64


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr, partial_ptr, arrivals_ptr, M, N, K, inter, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producer(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    cols = tl.arange(0, BLOCK_K)
    k_start = 0
    k_end = K
    if SPLIT_K > 1:  # this program's share of K, whole BLOCK_K steps
        k_share = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_start = tl.program_id(2) * k_share
        k_end = tl.minimum(k_start + k_share, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y.T tile
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + cols
        k_mask = k < k_end
        x = tl.load(
            x_ptr + ms[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        tile_mask = row_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=tile_mask, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        x_t = tl.trans(x)
        acc += tl.dot(w, x_t)
        if SILU_MUL:
            up_rows = rows + inter
            w_up = tl.load(w_ptr + up_rows[:, None] * stride_wn + k[None, :], mask=tile_mask, other=0.0)
            if DOT_F32:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(w_up, x_t)
    out_mask = row_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + ms[None, :] * stride_ym + rows[:, None]
    if SPLIT_K > 1:
        sum_split_partials(
            acc, acc_up, partial_ptr, arrivals_ptr, y_ptrs, rows, ms, out_mask, N, SILU_MUL, BLOCK_M, SPLIT_K
        )
    else:
        if SILU_MUL:
            acc = acc * tl.sigmoid(acc) * acc_up
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _config(block_n: int, block_k: int, warps: int, stages: int = 3, **extra: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, **extra}, num_warps=warps, num_stages=stages
    )


# (BLOCK_N, BLOCK_K, warps, stages, SPLIT_K): weight rows per program x K depth x pipeline depth x
# K splits (kernels/linear_split_k.py), pruned to what the H200 picked; split configs are tried only on shapes
# with few weight-row tiles. Tiles that overflow shared memory at large BLOCK_M fail to compile
# and are skipped.
_GEMM_CONFIGS = [
    _config(n, k, w, s, SPLIT_K=split)
    for n, k, w, s, split in [
        (16, 128, 2, 5, 1), (16, 512, 4, 3, 1), (32, 256, 4, 3, 1), (64, 128, 4, 4, 1),
        (128, 64, 4, 4, 1), (128, 64, 8, 5, 1), (128, 128, 8, 3, 1),
        (32, 256, 4, 3, 4), (64, 128, 4, 4, 4), (64, 128, 4, 4, 8), (128, 64, 8, 5, 8),
    ]
]  # fmt: skip
if max(c.kwargs["SPLIT_K"] for c in _GEMM_CONFIGS) > MAX_SPLIT_K:
    raise ValueError(f"a GEMM config splits K more than the split-K workspace holds ({MAX_SPLIT_K})")
# The interpreter's one config per kernel: small blocks, so the CPU tests' rows span several.
_INTERPRETER_CONFIGS: dict[str, dict[str, Any]] = {
    "gemv": {"BLOCK_N": 16, "BLOCK_K": 32},
    "normed_gemv": {"BLOCK_N": 2},
    "gemm": {"BLOCK_N": 16, "BLOCK_K": 32},
}
# The interpreter's GEMV programs per SM (0: one program per BLOCK_N rows; tests set others). The
# pre-normed GEMV is always persistent: it takes max(1, this).
INTERPRETER_GEMV_PER_SM = 0
# The interpreter's K splits for GEMM shapes that may split (tests set more than 1).
INTERPRETER_SPLIT_K = 1


def _quick_bench(kernel_call: Any, quantiles: Any) -> Any:
    """Triton's benchmark (L2 flushed before every run) with short windows: a decode linear takes
    microseconds, so 10 ms of repetitions is hundreds of runs, and ~8 configs x ~30 keys stay cheap."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=10, quantiles=quantiles)


def _autotuned(kernel: Any, configs: list[triton.Config], key: list[str], prune: Any = None) -> Any:
    if _INTERPRET:
        return kernel
    # cache_results: timings persist in Triton's cache dir, so later processes on the machine
    # (every rank, every restart) skip the benchmarking.
    return triton.autotune(
        configs,
        key=key,
        prune_configs_by={"early_config_prune": precompiling(kernel, prune)},
        do_bench=_quick_bench,
        cache_results=True,
    )(kernel)


_gemv = _autotuned(gemv_kernel, GEMV_CONFIGS, key=["N", "K", "SILU_MUL"])
_normed_gemv = _autotuned(
    normed_gemv_kernel, NORMED_GEMV_CONFIGS, key=["N", "K", "SILU_MUL"], prune=prune_normed_configs
)
_skinny_gemm = _autotuned(
    _skinny_gemm_kernel, _GEMM_CONFIGS, key=["N", "K", "BLOCK_M", "SILU_MUL"], prune=prune_split_configs
)


# The fields of a tuning key, after the kernel's name.
_KEY_FIELDS = ("N", "K", "BLOCK_M", "fused", "pre_norm", "dtype", "out_dtype")
# The autotuner's pick per tuning key, once it has tuned (or loaded) it outside graph capture.
_best_configs: dict[tuple[object, ...], triton.Config] = {}
# Per tuning key, whether cuBLAS measured faster than the tuned Triton kernel (decided eagerly).
_cublas_faster: dict[tuple[object, ...], bool] = {}
# Per tuning key, everything a launch needs besides the tensors (built once, after tuning).
_prepared: dict[tuple[object, ...], tuple[FastLaunch, dict[str, Any], list[Any], dict[str, int]]] = {}
_KERNELS = {
    "gemv": (_gemv, gemv_kernel),
    "normed_gemv": (_normed_gemv, normed_gemv_kernel),
    "gemm": (_skinny_gemm, _skinny_gemm_kernel),
}


@functools.cache
def _fast_launch(kind: str) -> FastLaunch:
    # Made on first use: FastLaunch binds the GPU driver, which a CPU-only import must not need.
    return FastLaunch(_KERNELS[kind][1])


def _run(
    kind: str,
    key: tuple[object, ...],
    grid_of: Callable[[dict[str, Any]], tuple[int, ...]],
    args: tuple[object, ...],
    constexprs: dict[str, Any],
) -> None:
    """The first launch of a tuning key goes through the autotuner (tuning it); later ones launch
    its pick straight through the compiled handle (``FastLaunch``), skipping the autotuner's and
    the JIT's per-call dispatch, which dominate an eager batch-1 decode step."""
    autotuned, kernel = _KERNELS[kind]
    if _INTERPRET:
        meta = {**_INTERPRETER_CONFIGS[kind], **constexprs}
        kernel[grid_of(meta)](*args, **meta)
        return
    prepared = _prepared.get(key)
    if prepared is not None:
        launch, meta, constexpr_values, options = prepared
        launch(grid_of(meta), *args, *constexpr_values, **options)
        return
    if _best_configs.get(key) is None:
        if torch.cuda.is_current_stream_capturing():
            # Tuning benchmarks, which a capture forbids: refuse with the shape, not inside Triton.
            shape = ", ".join(f"{name}={value}" for name, value in zip(_KEY_FIELDS, key[1:], strict=True))
            raise RuntimeError(
                f"Triton linear {kind} ({shape}) first met inside CUDA-graph capture: "
                "run one eager step of this batch bucket before capture"
            )
        autotuned[grid_of](*args, **constexprs, launch_pdl=constexprs["USE_PDL"])
        _best_configs[key] = autotuned.best_config
        return
    launch, meta, constexpr_values, options = _prepare(kind, key, len(args), constexprs)
    launch(grid_of(meta), *args, *constexpr_values, **options)


def _prepare(
    kind: str, key: tuple[object, ...], runtime_count: int, constexprs: dict[str, Any]
) -> tuple[FastLaunch, dict[str, Any], list[Any], dict[str, int]]:
    """What a tuned key launches with besides its runtime arguments (kept in ``_prepared``):
    the tuned pick's constexprs in parameter order and its launch options. Under the interpreter,
    the interpreter's fixed config and no options."""
    if _INTERPRET:
        meta = {**_INTERPRETER_CONFIGS[kind], **constexprs}
        kernel = _KERNELS[kind][1]
        return FastLaunch(kernel), meta, [meta[name] for name in kernel.arg_names[runtime_count:]], {}
    prepared = _prepared.get(key)
    if prepared is None:
        best = _best_configs[key]
        meta = {**constexprs, **best.kwargs}
        constexpr_values = [meta[name] for name in _KERNELS[kind][1].arg_names[runtime_count:]]
        options = {"num_warps": best.num_warps, "num_stages": best.num_stages, "launch_pdl": meta["USE_PDL"]}
        prepared = _prepared[key] = (_fast_launch(kind), meta, constexpr_values, options)
    return prepared


def _check(x: torch.Tensor, w: torch.Tensor, op: str) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]")
    if w.stride(1) != 1:
        raise ValueError(f"{op}: weight {tuple(w.shape)} must have contiguous rows, strides {w.stride()}")
    if x.dtype != w.dtype:
        raise ValueError(f"{op}: x dtype {x.dtype} differs from weight dtype {w.dtype}")


# Read-only zero rows per (shape, dtype, device), made outside graph capture and kept: the first
# layer's pre-norm has no residual, and filling a fresh one cost a kernel every decode step.
_ZEROS: dict[tuple[object, ...], torch.Tensor] = {}


def _zeros_like(x: torch.Tensor) -> torch.Tensor:
    key = (x.shape, x.dtype, x.device)
    zeros = _ZEROS.get(key)
    if zeros is None:
        zeros = torch.zeros_like(x, memory_format=torch.contiguous_format)
        # One made during a capture lives in the graph's memory pool: used there, never kept.
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            _ZEROS[key] = zeros
    return zeros


@dataclass(frozen=True)
class PreNorm:
    """The (1 + w) RMSNorm a linear applies to its input first (see ``kernels/linear.py``): the
    residual added before it, its weight (None: folded into the linear's columns) and eps, and
    ``h``, the buffer that receives the new residual stream x + residual."""

    residual: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    h: torch.Tensor

    @classmethod
    def build(
        cls, x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None
    ) -> PreNorm:
        if residual is None:
            # A zero residual keeps one kernel variant (x + 0 is x exactly); the first layer only.
            residual = _zeros_like(x)
        elif residual.shape != x.shape:
            raise ValueError(
                f"rms_norm_linear: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}"
            )
        return cls(residual.contiguous(), weight, eps, torch.empty_like(x))


def _tuning_key(
    x: torch.Tensor, n_out: int, silu_mul: bool, norm: PreNorm | None, y_dtype: torch.dtype
) -> tuple[object, ...]:
    """The kernel kind and the tuning key of one linear (``_KEY_FIELDS`` after the kind)."""
    m, k = x.shape
    block_m = 1 if m == 1 else min(max(next_pow2(m), _DOT_MIN_M), _DOT_MAX_BLOCK_M)
    kind = "gemm" if m > 1 else "gemv" if norm is None else "normed_gemv"
    pre_norm = "none" if norm is None else "unit" if norm.weight is None else "(1 + w)"
    return (kind, n_out, k, block_m, silu_mul, pre_norm, x.dtype, y_dtype)


def _arguments(
    key: tuple[object, ...], x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, norm: PreNorm | None
) -> tuple[Callable[[dict[str, Any]], tuple[int, ...]], tuple[object, ...], dict[str, Any], torch.Tensor]:
    """(grid of the config, runtime arguments, constexprs, h) of the key's kernel on these
    tensors, where h is the residual stream the norm leaves (x itself without one)."""
    kind, n_out = key[0], key[1]
    m, k = x.shape
    constexprs: dict[str, Any] = {"SILU_MUL": key[4], "USE_PDL": pdl_enabled()}
    h = x
    if kind != "gemm":
        grid_of = functools.partial(gemv_grid, n_out, x.device)
        args: tuple[object, ...] = (x, w, y, n_out, k, n_out, w.stride(0))
        if norm is not None:
            h = norm.h
            norm_weight = x if norm.weight is None else norm.weight  # never read without one
            args = (x, w, y, norm.residual, norm_weight, h, n_out, k, n_out, w.stride(0), norm.eps)
            constexprs.update(K_PAD=next_pow2(k), HAS_WEIGHT=norm.weight is not None)
        if _INTERPRET:
            per_sm = INTERPRETER_GEMV_PER_SM
            constexprs["PER_SM"] = per_sm if norm is None else max(1, per_sm)
        return grid_of, args, constexprs, h
    if norm is not None:
        raise ValueError("the skinny GEMM has no norm prologue: pre-norm rows with rms_norm first")
    block_m = key[3]
    split_ok = split_k_allowed(n_out, k, x.device)
    workspace = split_k_workspace(x.device, cdiv(m, block_m), block_m, n_out, key[4]) if split_ok else None
    partials, arrivals = workspace or no_workspace(x.device)
    grid_of = lambda meta: (cdiv(n_out, meta["BLOCK_N"]), cdiv(m, block_m), meta["SPLIT_K"])  # noqa: E731
    args = (x, w, y, partials, arrivals, m, n_out, k, n_out, x.stride(0), w.stride(0), y.stride(0))
    constexprs.update(BLOCK_M=block_m, DOT_F32=_INTERPRET)
    if _INTERPRET:
        constexprs["SPLIT_K"] = INTERPRETER_SPLIT_K if split_ok else 1
    return grid_of, args, constexprs, h


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    n_out: int,
    silu_mul: bool,
    norm: PreNorm | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): y = f(x) @ w.T over n_out rows (or the fused silu(gate) * up over rows j and
    j + n_out), where f is ``norm`` or the identity, and h the residual stream the norm leaves
    (x itself without one); for a tuning key where cuBLAS measured faster, cuBLAS's answer.
    ``out`` (plain linears only) receives y instead of a new tensor; ``out_dtype`` (plain linears
    only, default x's) is the dtype of a new y, which the kernels store from their fp32 sums."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y_dtype = x.dtype if out_dtype is None else out_dtype
    key = _tuning_key(x, n_out, silu_mul, norm, y_dtype)
    decided = _cublas_faster.get(key)
    if decided:
        return _cublas(x, w, silu_mul, norm, out, out_dtype)
    y = torch.empty((m, n_out), dtype=y_dtype, device=x.device) if out is None else out
    if m == 0 or n_out == 0:
        return y, x if norm is None else norm.h
    kind = key[0]
    grid_of, args, constexprs, h = _arguments(key, x, w, y, norm)
    _run(kind, key, grid_of, args, constexprs)
    if decided is None and not _INTERPRET and not torch.cuda.is_current_stream_capturing():
        run = functools.partial(_run, kind, key, grid_of, args, constexprs)
        shape = {name: str(value) for name, value in zip(_KEY_FIELDS, key[1:], strict=True)}
        best = _best_configs.get(key)
        config = None if best is None else f"{best.kwargs} warps={best.num_warps} stages={best.num_stages}"
        _cublas_faster[key] = cublas_beats_triton(
            key[0], shape, config, run, lambda: _cublas(x, w, silu_mul, norm, out_dtype=out_dtype)
        )
        if _cublas_faster[key]:  # from its first call on, a key answers from one backend only
            return _cublas(x, w, silu_mul, norm, out, out_dtype)
    return y, h


def _cublas(
    x: torch.Tensor,
    w: torch.Tensor,
    silu_mul: bool,
    norm: PreNorm | None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same op through cuBLAS, with the separate norm kernel before it and the SiLU-and-mul
    kernel after it where the op fuses them."""
    if out is not None:  # a plain linear into the caller's buffer (F.linear is this same mm)
        return torch.mm(x, w.t(), out=out), x
    if out_dtype is not None and out_dtype != x.dtype:  # a plain linear: cuBLAS stores its fp32 sums
        return torch.mm(x, w.t(), out_dtype=out_dtype), x
    h = x
    if norm is not None:
        from phalanx.kernels.norms_triton import rms_norm_triton

        x, h = rms_norm_triton(x, norm.weight, norm.eps, norm.residual)
    y = F.linear(x, w)
    if silu_mul:
        from phalanx.kernels.activation_triton import silu_and_mul_triton

        y = silu_and_mul_triton(y)
    return y, h


def linear_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T, into ``out`` ([M, N], contiguous, x's dtype) when given."""
    _check(x, w, "linear")
    if out is not None:
        check_out(out, x, w)
    return _launch(x, w, w.shape[0], silu_mul=False, out=out)[0]


def linear_fp32_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float32, the kernels' sums never rounded to x's dtype (the vocab head's logits)."""
    _check(x, w, "linear_fp32")
    return _launch(x, w, w.shape[0], silu_mul=False, out_dtype=torch.float32)[0]


def _gate_up_rows(w_gate_up: torch.Tensor) -> int:
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"linear_silu_and_mul: gate_up weight has an odd row count {w_gate_up.shape[0]}")
    return w_gate_up.shape[0] // 2


def linear_silu_and_mul_triton(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    _check(x, w_gate_up, "linear_silu_and_mul")
    return _launch(x, w_gate_up, _gate_up_rows(w_gate_up), silu_mul=True)[0]


def _pre_normed(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    silu_mul: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of K up to ``NORMED_MAX_K`` (read here, so tests can lower it): the pre-normed GEMV.
    More rows, or wider ones: the norm kernel, then the skinny GEMM or the plain GEMV. A norm
    prologue in the GEMM lost to norm + cuBLAS at every 4B shape and batch bucket on the H200 (it
    re-reads the rows' K once more before the MMA loop), so it was dropped."""
    n_out = _gate_up_rows(w) if silu_mul else w.shape[0]
    if x.shape[0] == 1 and x.shape[1] <= linear_gemv_triton.NORMED_MAX_K:
        return _launch(x, w, n_out, silu_mul, PreNorm.build(x, weight, eps, residual))
    from phalanx.kernels.norms_triton import rms_norm_triton

    normed, h = rms_norm_triton(x, weight, eps, residual)
    return _launch(normed, w, n_out, silu_mul)[0], h


def rms_norm_linear_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, w, "rms_norm_linear")
    return _pre_normed(x, weight, eps, residual, w, silu_mul=False)


def rms_norm_linear_silu_and_mul_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    w_gate_up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, w_gate_up, "rms_norm_linear_silu_and_mul")
    return _pre_normed(x, weight, eps, residual, w_gate_up, silu_mul=True)
