"""Split-K for the skinny decode GEMM: more programs for the linears with few output rows.

At M >= 2 the skinny GEMM has one program per BLOCK_N weight rows (and BLOCK_M batch rows). The
projections back into the hidden size (down_proj, out_proj, o_proj: N = 2560 at the 4B geometry)
then have only ~40 programs for 132 SMs. Split-K cuts K into SPLIT_K shares, one program each,
and sums the shares without a second launch or a zeroed buffer: each program stores its fp32
partial tile, and the one that arrives last at the tile's counter (an atomic add) sums every split
in split order, stores y, and resets the counter to zero for the next launch. The order is fixed,
so the answer does not depend on which split finished last, and a CUDA-graph replay equals the
eager launch bit for bit.

The partials and counters are one per-device workspace (``kernels/workspace.py``), shared by every
split launch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import sm_count
from phalanx.kernels.workspace import GrowOnlyWorkspace

MAX_SPLIT_K = 8
# Each split keeps at least this many BLOCK_K steps in its pipeline.
_MIN_STEPS_PER_SPLIT = 2

_WORKSPACE = GrowOnlyWorkspace("split-K GEMM workspace", (torch.float32, torch.int32), (False, True))


@triton.jit
def sum_split_partials(acc, acc_up, partial_ptr, arrivals_ptr, y_ptrs, rows, ms, out_mask, N,
                       SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """The skinny GEMM's split-K epilogue for the program holding ``acc`` (and ``acc_up``, the up
    rows' tile, when fused with SiLU-and-mul): the y.T tile of weight rows ``rows`` and batch rows
    ``ms`` over its share of K, in a grid of (N tiles, M tiles, SPLIT_K)."""
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    split_stride = tl.num_programs(1) * BLOCK_M * N  # one split's [M rounded up to blocks, N] partials
    up_offset = SPLIT_K * split_stride  # the up rows' partials follow all the gate rows' ones
    part = ms[None, :] * N + rows[:, None]
    mine = partial_ptr + tl.program_id(2) * split_stride + part
    tl.store(mine, acc, mask=out_mask)
    if SILU_MUL:
        tl.store(mine + up_offset, acc_up, mask=out_mask)
    tl.debug_barrier()  # every thread's partial is written before the counter says so
    arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros((acc.shape[0], BLOCK_M), dtype=tl.float32)
        total_up = tl.zeros((acc.shape[0], BLOCK_M), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            # .cg: from L2, where the other splits' stores are, never from this SM's L1.
            theirs = partial_ptr + split * split_stride + part
            total += tl.load(theirs, mask=out_mask, cache_modifier=".cg")
            if SILU_MUL:
                total_up += tl.load(theirs + up_offset, mask=out_mask, cache_modifier=".cg")
        if SILU_MUL:
            total = total * tl.sigmoid(total) * total_up
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=out_mask)
        tl.store(arrivals_ptr + tile, 0)


def split_k_allowed(n: int, k: int, device: torch.device) -> bool:
    """Whether this GEMM shape may split K: on a GPU, with fewer 64-row tiles than half the SMs
    and K long enough for two splits. On the H200 split configs won only such thin shapes (N = 2560
    at M = 16 and 32), and every split config is one more compile per batch bucket in a cold
    pre-capture sweep. Off the GPU (the interpreter's CPU tests) every shape may split."""
    if device.type != "cuda":
        return True
    return triton.cdiv(n, 64) < sm_count(device) // 2 and k >= 2 * _MIN_STEPS_PER_SPLIT * 64


def prune_split_configs(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """The autotuner's early prune: split configs only for shapes that may split, and only splits
    that leave each program at least two BLOCK_K steps."""
    n, k, device = int(named_args["N"]), int(named_args["K"]), named_args["x_ptr"].device
    split_ok = split_k_allowed(n, k, device)
    return [
        c
        for c in configs
        if c.kwargs["SPLIT_K"] == 1
        or (split_ok and k >= _MIN_STEPS_PER_SPLIT * c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"])
    ]


@functools.cache
def no_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What a GEMM that never splits passes for the workspace (never touched)."""
    partials = torch.empty(1, dtype=torch.float32, device=device)
    return partials, torch.zeros(1, dtype=torch.int32, device=device)


def split_k_workspace(
    device: torch.device, m_blocks: int, block_m: int, n: int, silu_mul: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials fp32, arrival counters int32, zeroed) big enough for MAX_SPLIT_K splits of an
    [m_blocks * block_m, n] output (twice, gate and up, when fused with SiLU-and-mul) in tiles of
    at least 16 rows. Grows outside capture only."""
    partials_needed = MAX_SPLIT_K * (2 if silu_mul else 1) * m_blocks * block_m * n
    counters_needed = m_blocks * triton.cdiv(n, 16)
    partials, arrivals = _WORKSPACE.get(
        device, (partials_needed, counters_needed), f"{m_blocks * block_m} x {n}"
    )
    return partials, arrivals
