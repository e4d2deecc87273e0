"""The Triton GEMVs of batch-1 decode (M = 1): plain, and with the decoder's pre-norm in the prologue.

Batch-1 decode is bound by reading the weights once, so both are built for bandwidth, and both
take the MLP's fused form (``SILU_MUL``: the gate_up weight ``[2I, K]``; each program reads gate
rows ``j`` and the matching up rows ``j + I`` and writes ``silu(gate) * up``). Dispatch, tuning and
the cuBLAS race are ``kernels/linear_triton.py``'s.

- **Plain GEMV** (``gemv_kernel``): every program streams ``BLOCK_N`` weight rows through wide,
  contiguous ``BLOCK_K`` loads (16-byte vectors) and keeps an fp32 partial product per element,
  reduced over K only once at the end (no per-iteration shuffles or barriers). ``PER_SM = 0``: one
  program per ``BLOCK_N`` rows, so small blocks give thousands of programs and every SM has several
  resident; ``PER_SM > 0``: persistent, an equal share of the rows per program.
- **Pre-normed GEMV** (``normed_gemv_kernel``, K up to ``NORMED_MAX_K``): the residual add and the
  (1 + w) RMSNorm before a decoder linear, then the products. Each persistent program reads the
  whole x + residual row once (one wide load from L2), scales it by (1 + w) and keeps it in
  registers in fp32, so its loop over row blocks reads nothing but weights: each step loads
  ``BLOCK_N`` whole rows (K padded to a power of two, the padding masked off) and requests the
  next block's rows before reducing these, so two blocks of rows are in flight per program. Program 0 writes the new residual stream.
  Folding the norm into each K block instead delays every block's weight loads behind the x,
  residual and norm-weight loads. Row blocks are dealt to the programs in turn, not in contiguous
  shares, and the weight loads are marked evict-first (in the plain GEMV neither helped). The norm
  weight and the residual are loaded before the PDL wait (the residual stream was written two or
  more launches back, see ``kernels/launch.py``), so after it the prologue waits on x's load alone
  instead of three loads and a reduction in a row. 1/rms multiplies each row's sum rather than x,
  so the first products start while the norm's reduction (a barrier across the program's warps)
  is still running, and x * (1 + w) is not rounded to bf16 first, which is also nearer fp32.
  Each of these choices was measured on the H200: docs/benchmarks/kernel-choices-h200.md.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from phalanx.kernels.launch import cdiv, sm_count, wait_for_producer

# The widest K the pre-normed GEMV keeps in registers (x in fp32 and two blocks of whole rows);
# wider rows are normed by the norm kernel first and then run the plain GEMV.
NORMED_MAX_K = 8192
# Pre-normed configs keep at most this many weight elements per thread in one block of rows (the
# prefetched block doubles it), so none spills.
_NORMED_MAX_ELEMENTS_PER_THREAD = 64


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, y_ptr, N, K, inter, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_SM: tl.constexpr, SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if PER_SM == 0:  # one program per BLOCK_N rows
        start = tl.program_id(0) * BLOCK_N
        end = tl.minimum(start + BLOCK_N, N)
    else:  # persistent: an equal share of the rows per program, every program resident at once
        start = tl.program_id(0) * N // tl.num_programs(0)
        end = (tl.program_id(0) + 1) * N // tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    # The first weight tile is requested before waiting for the previous kernel (under PDL it is
    # still running): the weights never change, and the tile arrives while the wait goes on.
    w, w_up = _weight_tile(w_ptr, start + tl.arange(0, BLOCK_N), end, cols, K, inter, stride_wn, SILU_MUL)
    wait_for_producer(USE_PDL)
    for r0 in range(start, end, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        row_mask = rows < end
        w_rows = w_ptr + rows[:, None] * stride_wn
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * x[None, :]
        acc_up = acc
        if SILU_MUL:
            acc_up = w_up.to(tl.float32) * x[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + cols
            k_mask = k < K
            x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            tile_mask = row_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + k[None, :], mask=tile_mask, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            if SILU_MUL:
                w_up = tl.load(w_rows + inter * stride_wn + k[None, :], mask=tile_mask, other=0.0)
                acc_up += w_up.to(tl.float32) * x[None, :]
        # The next rows' first tile is on its way while these rows are reduced and stored.
        w, w_up = _weight_tile(w_ptr, rows + BLOCK_N, end, cols, K, inter, stride_wn, SILU_MUL)
        _store_rows(y_ptr, rows, row_mask, tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), SILU_MUL)


@triton.jit
def normed_gemv_kernel(
    x_ptr, w_ptr, y_ptr, res_ptr, nw_ptr, h_ptr, N, K, inter, stride_wn, eps,
    BLOCK_N: tl.constexpr, K_PAD: tl.constexpr, PER_SM: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # Persistent (PER_SM programs per SM set the grid), the row blocks dealt out in turn: program
    # p takes blocks p, p + P, p + 2P, ..., so at any moment the programs read neighbouring rows.
    step = tl.num_programs(0) * BLOCK_N
    start = tl.program_id(0) * BLOCK_N
    cols = tl.arange(0, K_PAD)
    k_mask = cols < K
    w, w_up = _weight_tile(w_ptr, start + tl.arange(0, BLOCK_N), N, cols, K, inter, stride_wn, SILU_MUL, True)
    # Also before the wait: the norm weight and the residual (see the module docstring).
    if HAS_WEIGHT:
        nw = tl.load(nw_ptr + cols, mask=k_mask, other=0.0)
    res = tl.load(res_ptr + cols, mask=k_mask, other=0.0)
    wait_for_producer(USE_PDL)
    x = tl.load(x_ptr + cols, mask=k_mask, other=0.0)
    # x + residual, rounded to the model dtype: the residual stream is stored in it.
    h = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
    if tl.program_id(0) == 0:
        tl.store(h_ptr + cols, h, mask=k_mask)
    hf = h.to(tl.float32)
    # 1/rms scales each row's sum, not x: the products need not wait for the norm's reduction.
    scaled = hf[None, :]
    if HAS_WEIGHT:
        scaled = (hf * (1.0 + nw.to(tl.float32)))[None, :]
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
    for r0 in range(start, N, step):
        rows = r0 + tl.arange(0, BLOCK_N)
        w_next, w_up_next = _weight_tile(w_ptr, rows + step, N, cols, K, inter, stride_wn, SILU_MUL, True)
        out = tl.sum(w.to(tl.float32) * scaled, axis=1) * inv
        out_up = out
        if SILU_MUL:
            out_up = tl.sum(w_up.to(tl.float32) * scaled, axis=1) * inv
        _store_rows(y_ptr, rows, rows < N, out, out_up, SILU_MUL)
        w, w_up = w_next, w_up_next


@triton.jit
def _weight_tile(
    w_ptr, rows, end, cols, K, inter, stride_wn, SILU_MUL: tl.constexpr, EVICT_FIRST: tl.constexpr = False
):
    """The [rows, cols] weight tile (and the matching up rows' one when fused), rows < end, cols < K;
    ``EVICT_FIRST`` marks its lines first out of L2 (each weight is read once a step)."""
    mask = (rows < end)[:, None] & (cols < K)[None, :]
    w_rows = w_ptr + rows[:, None] * stride_wn
    w = _load(w_rows + cols[None, :], mask, EVICT_FIRST)
    w_up = w
    if SILU_MUL:
        w_up = _load(w_rows + inter * stride_wn + cols[None, :], mask, EVICT_FIRST)
    return w, w_up


@triton.jit
def _load(ptrs, mask, EVICT_FIRST: tl.constexpr):
    if EVICT_FIRST:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_rows(y_ptr, rows, row_mask, out, out_up, SILU_MUL: tl.constexpr):
    if SILU_MUL:
        out = out * tl.sigmoid(out) * out_up
    tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=row_mask)


def _config(**kwargs: int) -> triton.Config:
    warps = kwargs.pop("warps")
    return triton.Config(kwargs, num_warps=warps, num_stages=3)


# (BLOCK_N, BLOCK_K, warps, PER_SM): from two rows per program with long loads to 32 rows with
# short ones, each keeping at most 64 fp32 accumulators a thread (twice BLOCK_N x BLOCK_K / threads
# when fused), so none spills. With PER_SM = 0 a thin last wave of programs leaves most SMs idle at
# the kernel's end; the persistent config kept won out_proj and down_proj (N = 2560) in every H200
# run (docs/benchmarks/kernel-choices-h200.md). The list is what the H200 picked for the 4B and 9B shapes out of
# three times as many candidates: every candidate costs a compile in each cold pre-capture sweep.
GEMV_CONFIGS = [
    _config(BLOCK_N=n, BLOCK_K=k, warps=w, PER_SM=per_sm)
    for n, k, w, per_sm in [
        (2, 1024, 4, 0), (2, 2048, 8, 0), (4, 512, 4, 0), (4, 1024, 8, 0), (8, 256, 4, 0),
        (8, 256, 8, 0), (16, 128, 4, 0), (16, 256, 8, 0), (32, 128, 8, 0), (2, 1024, 4, 16),
    ]
]  # fmt: skip
# (BLOCK_N, warps, PER_SM) of the pre-normed GEMV, 8 warps each: one or two whole rows a step at
# four programs per SM win alone, and their 4-warp twins, as fast alone, lose inside whole steps
# (measured: docs/benchmarks/kernel-choices-h200.md).
NORMED_GEMV_CONFIGS = [
    _config(BLOCK_N=n, warps=w, PER_SM=per_sm) for n, w, per_sm in [(1, 8, 4), (2, 8, 4), (4, 8, 2)]
]


def prune_normed_configs(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """Drops pre-normed configs whose block of whole rows is too many elements per thread for the
    registers (fused: gate and up rows count twice); keeps at least the lightest."""
    elements = kwargs["K_PAD"] * (2 if kwargs["SILU_MUL"] else 1)

    def per_thread(config: triton.Config) -> int:
        return config.kwargs["BLOCK_N"] * elements // (32 * config.num_warps)

    fitting = [c for c in configs if per_thread(c) <= _NORMED_MAX_ELEMENTS_PER_THREAD]
    return fitting or [min(configs, key=per_thread)]


def gemv_grid(n: int, device: Any, meta: dict[str, Any]) -> tuple[int]:
    """One program per BLOCK_N rows, or (PER_SM > 0) PER_SM per SM, never more than the blocks."""
    blocks = cdiv(n, meta["BLOCK_N"])
    if meta["PER_SM"] == 0:
        return (blocks,)
    # Off the GPU (the interpreter's tests) 4 "SMs": a few programs, each over several row blocks.
    sms = sm_count(device) if device.type == "cuda" else 4
    return (min(blocks, meta["PER_SM"] * sms),)
