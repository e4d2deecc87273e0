"""The Gated DeltaNet decode step (see ``kernels/gdn_step.py``) on CUDA.

One kernel, grid (dv / BV, Hv, batch): each program owns one [dk, BV] fp32 state tile of one value
head of one row, so a small batch still spreads over many SMs; BV and num_warps are tuned per
batch bucket (``kernels/gdn_tiles.py``). Each program

1. loads its state tile (and, with the conv, its conv weights and its channels' stored conv
   inputs) *before* waiting for the kernel before it (under PDL that is still draining): nothing
   it reads there is written by that kernel. The recurrent and conv state were last written by
   this layer's step in an earlier decode step, and any slot copy or prefill that touched them ran
   before that kernel started, which PDL implies (everything two launches back has finished:
   the rule is in ``kernels/launch.py``). Without the conv, the input projection is two launches
   back, so its gates and z are read there too;
2. convolves its key head's q and k channels and its own BV v channels (conv + SiLU, rounded to
   the model dtype as the conv kernel stores them), L2-normalises q and k, computes the gates and
   runs the delta-rule step, storing the state tile, its v channels' new conv inputs, and o
   (rounded to the model dtype) into a per-head fp32 workspace;
3. counts itself in: the program that arrives last runs the gated RMSNorm over the whole dv,
   reading the o tiles back from L2, and resets the counter. Without the conv the count is per
   (row, value head) and the last program norms its own head, not both of its key head's in turn,
   and a program whose tile spans the whole dv norms it from its registers with no count. With the
   conv it is per (row, key head): after every program of the key head has read the old conv
   state, the last one stores the q/k channels' new conv inputs (all programs computed the same
   ones) and norms each value head of the key head.

Nothing depends on which program arrives last, so a CUDA-graph replay equals the eager launch bit
for bit. The split path runs the conv kernel (``kernels/conv1d_triton.py``, every channel once)
first and then this kernel without its conv (``CONV`` off), the default (``GDN_PATH``): the fused
kernel's per-program q/k convolution is traffic the conv kernel does once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from phalanx.config import settings
from phalanx.kernels.conv1d_triton import (
    causal_conv1d_decode_triton,
    conv_decode_arguments,
    conv_decode_launch,
    conv_state_window,
    conv_step,
    store_conv_state,
)
from phalanx.kernels.gdn import RECURRENT_STATE_DTYPES
from phalanx.kernels.gdn_step import gdn_split_sizes
from phalanx.kernels.gdn_tiles import (
    FIXED_TILES,
    INTERPRET_TILE,
    Tile,
    TunedTiles,
    autotuned,
    launch_options,
    tuning_bucket,
)
from phalanx.kernels.gdn_triton import l2_normalize, softplus_gate
from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, pdl_enabled, wait_for_producer
from phalanx.kernels.workspace import GrowOnlyWorkspace

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# PHALANX_GDN=split|fused (read once, here): the decode step's path at every batch size. Split is
# the default: its graph step is faster (every fused program convolves its key head's q and k
# itself, traffic the conv kernel does once); fused saves a launch, which only host-bound eager
# batch 1 notices (measured: docs/benchmarks/kernel-choices-h200.md).
GDN_PATH = settings.gdn_path()


@triton.jit
def _conv_channels(cw_ptr, cs_row, ch, mask, tap, K: tl.constexpr):
    """The state-row pointers of channels ``ch`` and what their conv step reads besides the new
    inputs: the stored inputs (``conv_state_window``) and the weights."""
    state_rows = cs_row + ch * (K - 1)
    old, later = conv_state_window(state_rows, tap, mask, K)
    w = tl.load(cw_ptr + ch[:, None] * K + tap[None, :], mask=mask[:, None] & (tap < K)[None, :], other=0.0)
    return state_rows, old, later, w


# tuning_bucket only keys the autotuner: unspecialised, bucket 1 compiles the same binary as 64.
@triton.jit(do_not_specialize=["tuning_bucket"])
def _step_kernel(
    x_ptr, cw_ptr, cs_ptr, z_ptr, a_ptr, b_ptr, alog_ptr, dt_ptr, nw_ptr, state_ptr, slots_ptr, y_ptr,
    o_ws_ptr, arrivals_ptr, stride_x, stride_cs, stride_z, stride_a, stride_b, stride_slot, eps, scale,
    tuning_bucket,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    TAPS: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, CONV: tl.constexpr, BV: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """With CONV, x is the input projection's qkv rows and the kernel runs the conv too; without,
    x is the conv kernel's output and the conv state is not touched here."""
    vb = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    RATIO: tl.constexpr = HV // HK
    kh = h // RATIO
    dk = tl.arange(0, BK)
    dv = vb * BV + tl.arange(0, BV)
    tap = tl.arange(0, TAPS)
    k_mask = dk < DK
    v_mask = dv < DV
    s_mask = k_mask[:, None] & v_mask[None, :]

    # 1. Before the wait (see the module docstring for why these reads are safe there).
    slot = tl.load(slots_ptr + row)
    s_ptrs = state_ptr + slot * stride_slot + h * DK * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    q_ch, k_ch, v_ch = kh * DK + dk, HK * DK + kh * DK + dk, 2 * HK * DK + h * DV + dv
    if CONV:
        cs_row = cs_ptr + slot * stride_cs
        q_rows, q_old, q_later, q_w = _conv_channels(cw_ptr, cs_row, q_ch, k_mask, tap, K)
        k_rows, k_old, k_later, k_w = _conv_channels(cw_ptr, cs_row, k_ch, k_mask, tap, K)
        v_rows, v_old, v_later, v_w = _conv_channels(cw_ptr, cs_row, v_ch, v_mask, tap, K)
    dt = tl.load(dt_ptr + h).to(tl.float32)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    cols = tl.arange(0, BDV)
    cols_mask = cols < DV
    nw = tl.load(nw_ptr + cols, mask=cols_mask, other=0.0).to(tl.float32)
    if not CONV:  # the input projection ran two launches back: its gates and z are whole
        a = tl.load(a_ptr + row * stride_a + h).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + h).to(tl.float32)
        zf = tl.load(z_ptr + row * stride_z + h * DV + cols, mask=cols_mask, other=0.0).to(tl.float32)
    wait_for_producer(USE_PDL)

    # 2. Conv, gates, the delta rule on this tile.
    x_row = x_ptr + row * stride_x
    dtype = y_ptr.dtype.element_ty
    q = tl.load(x_row + q_ch, mask=k_mask, other=0.0)
    k = tl.load(x_row + k_ch, mask=k_mask, other=0.0)
    v = tl.load(x_row + v_ch, mask=v_mask, other=0.0)
    if CONV:  # rounded to the model dtype, as the conv kernel stores its output
        q, q_new = conv_step(q_old, q_later, q, q_w, tap, K)
        k, k_new = conv_step(k_old, k_later, k, k_w, tap, K)
        v, v_new = conv_step(v_old, v_later, v, v_w, tap, K)
    q = l2_normalize(q.to(dtype).to(tl.float32), scale)
    k = l2_normalize(k.to(dtype).to(tl.float32), 1.0)
    v = v.to(dtype).to(tl.float32)
    if CONV:  # the input projection is the kernel before this one
        a = tl.load(a_ptr + row * stride_a + h).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + h).to(tl.float32)
    beta = tl.sigmoid(b)
    s = s * tl.exp(softplus_gate(a, dt, a_log))
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0).to(dtype).to(tl.float32)
    # Threads sharing an element (a tile smaller than the program) must all have read it first.
    tl.debug_barrier()
    tl.store(s_ptrs, s, mask=s_mask, eviction_policy="evict_first")
    if CONV:
        store_conv_state(v_rows, v_new, v_mask, tap, K)  # this program's v channels are its own

    # 3. The last program of the group finishes what needs all of them: of the (row, key head)
    # with the conv (the q/k channels' conv inputs are the key head's), else of the (row, value
    # head); a program holding its whole value head (BV = dv) needs no one else.
    NVB: tl.constexpr = (DV + BV - 1) // BV
    if not CONV and NVB == 1:
        _gated_norm_store(o, zf, nw, y_ptr + (row * HV + h) * DV, cols, cols_mask, eps, DV)
        return
    tl.store(o_ws_ptr + (row * HV + h) * DV + dv, o, mask=v_mask)
    tl.debug_barrier()  # every thread's reads and stores are done before the counter says so
    if CONV:
        counter = arrivals_ptr + row * HV + kh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == RATIO * NVB - 1:
            store_conv_state(q_rows, q_new, k_mask, tap, K)
            store_conv_state(k_rows, k_new, k_mask, tap, K)
            for r in tl.static_range(RATIO):
                head = kh * RATIO + r
                z = tl.load(z_ptr + row * stride_z + head * DV + cols, mask=cols_mask, other=0.0)
                _gated_norm_head(
                    o_ws_ptr, y_ptr, row * HV + head, z.to(tl.float32), nw, cols, cols_mask, eps, DV
                )
            tl.store(counter, 0)
    else:
        counter = arrivals_ptr + row * HV + h
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NVB - 1:
            _gated_norm_head(o_ws_ptr, y_ptr, row * HV + h, zf, nw, cols, cols_mask, eps, DV)
            tl.store(counter, 0)


@triton.jit
def _gated_norm_head(o_ws_ptr, y_ptr, head_row, zf, nw, cols, cols_mask, eps, DV: tl.constexpr):
    """The gated RMSNorm of one value head of one row (``head_row`` = row * Hv + head), its o read
    back from the workspace: ``.cg``, from L2, where the other programs' o tiles are, never from
    this SM's L1."""
    head_o = tl.load(o_ws_ptr + head_row * DV + cols, mask=cols_mask, other=0.0, cache_modifier=".cg")
    _gated_norm_store(head_o, zf, nw, y_ptr + head_row * DV, cols, cols_mask, eps, DV)


@triton.jit
def _gated_norm_store(head_o, zf, nw, y_head_ptr, cols, cols_mask, eps, DV: tl.constexpr):
    """y = nw * rmsnorm(o) * silu(z) over one value head's dv (o zero past dv), stored."""
    inv = tl.rsqrt(tl.sum(head_o * head_o, axis=0) / DV + eps)
    dtype = y_head_ptr.dtype.element_ty
    normed = (head_o * inv).to(dtype).to(tl.float32)
    y = nw * normed * (zf * tl.sigmoid(zf))
    tl.store(y_head_ptr + cols, y.to(dtype), mask=cols_mask)


_tuned_kernel = autotuned(_step_kernel, key=["tuning_bucket", "HK", "HV", "DK", "DV", "CONV"])
_step_launch = FastLaunch(_step_kernel, pdl=True)
TUNED = TunedTiles("gdn step kernel", FIXED_TILES)
# Per device: each row's o tiles [rows, Hv, dv] fp32, and one arrival counter per (row, value head).
# Sized for at least the largest decode graph bucket (4 MiB at the 4B geometry), so that a graph
# capture never meets a workspace too small for it.
_MIN_WORKSPACE_ROWS = 256
_WORKSPACE = GrowOnlyWorkspace("GDN step workspace", (torch.float32, torch.int32), (False, True))


def _workspace(
    device: torch.device, rows: int, hk: int, hv: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    o_ws, arrivals = _WORKSPACE.get(device, (rows * hv * dv, rows * hv), needed_for=f"{rows} rows")
    return o_ws, arrivals


def check_step_states(conv_state: torch.Tensor, state: torch.Tensor, conv_dim: int, kernel: int) -> None:
    """The decode step's layout contract for both states (raises ValueError with the shapes)."""
    if not state.is_contiguous() or state.dtype not in RECURRENT_STATE_DTYPES:
        raise ValueError(
            f"recurrent state must be contiguous float32 or bfloat16, got {state.dtype} {state.stride()}"
        )
    if not conv_state.is_contiguous() or conv_state.shape[1:] != (conv_dim, kernel - 1):
        raise ValueError(
            f"conv_state must be contiguous [slots, {conv_dim}, {kernel - 1}], got {tuple(conv_state.shape)}"
        )


def gdn_decode_step_fused(mixed_qkv: torch.Tensor, *args: Any) -> torch.Tensor:
    """``gdn_decode_step`` as the single fused kernel."""
    return _step(mixed_qkv, *args, conv=True)


def gdn_decode_step_split(
    mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, *args: Any
) -> torch.Tensor:
    """``gdn_decode_step`` as the conv kernel, then the step kernel without its conv."""
    if conv_weight.dim() != 2:  # the model keeps it [conv_dim, K] already
        conv_weight = conv_weight.reshape(mixed_qkv.shape[1], conv_weight.shape[-1])
    conv_out = causal_conv1d_decode_triton(mixed_qkv, conv_weight, conv_state, args[-1])
    return _step(conv_out, conv_weight, conv_state, *args, conv=False)


def _step(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    conv: bool,
) -> torch.Tensor:
    """The step kernel on x: the input projection's qkv rows (``conv``) or the conv's output."""
    step = _Step.build(
        x, conv_weight, conv_state, z, a, b, A_log, dt_bias, norm_weight, eps, state, state_slots, conv
    )
    if step.batch:
        step.launch(step.tile())
    return step.tensors[-1]


class _Step:
    """One call's kernel arguments: the model's tensors, the workspace, the scalars, the shape."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        workspace: list[torch.Tensor],
        scalars: list[object],
        shape: dict[str, int],
        key: tuple[object, ...],
    ) -> None:
        self.tensors, self.workspace, self.scalars, self.shape, self.key = (
            tensors,
            workspace,
            scalars,
            shape,
            key,
        )
        self.batch = tensors[0].shape[0]

    @classmethod
    def build(
        cls,
        x: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_state: torch.Tensor,
        z: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        state: torch.Tensor,
        state_slots: torch.Tensor,
        conv: bool,
    ) -> _Step:
        """Checks the layouts, makes the inputs contiguous where they are not, allocates y."""
        batch, conv_dim = x.shape
        hk, dk, hv, dv = gdn_split_sizes(conv_dim, state)
        kernel = conv_weight.shape[-1]
        check_step_states(conv_state, state, conv_dim, kernel)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if z.stride(-1) != 1 or z.stride(-2) != dv:
            z = z.contiguous()
        if a.stride(-1) != 1:
            a = a.contiguous()
        if b.stride(-1) != 1:
            b = b.contiguous()
        if not conv_weight.is_contiguous():
            conv_weight = conv_weight.contiguous()
        y = torch.empty((batch, hv, dv), dtype=x.dtype, device=x.device)
        bucket = tuning_bucket(batch)
        o_ws, arrivals = _workspace(x.device, max(batch, _MIN_WORKSPACE_ROWS), hk, hv, dv)
        tensors = [x, conv_weight, conv_state, z, a, b, A_log, dt_bias, norm_weight, state, state_slots, y]
        strides = [x.stride(0), conv_state.stride(0), z.stride(0), a.stride(0), b.stride(0), state.stride(0)]
        shape = dict(
            HK=hk,
            HV=hv,
            DK=dk,
            DV=dv,
            K=kernel,
            TAPS=next_pow2(kernel),
            BK=next_pow2(dk),
            BDV=next_pow2(dv),
            CONV=conv,
        )
        # The model dtype stands for the others: the tile is a speed choice (see TunedTiles).
        key = (bucket, hk, hv, dk, dv, conv, x.dtype, state.dtype, state.device)
        return cls(tensors, [o_ws, arrivals], [*strides, eps, dk**-0.5, bucket], shape, key)

    def tile(self) -> Tile:
        """The (BV, num_warps) tile of this call's bucket: tuned on its first call."""
        if _INTERPRET:
            return INTERPRET_TILE
        tile = TUNED.tiles.get(self.key)
        if tile is None:
            capturing = torch.cuda.is_current_stream_capturing()
            tile = TUNED.tile(self.key, capturing, lambda: self.tune_on_scratch(self.shape, self.key[0]))
        return tile

    def arguments(self, tile: Tile) -> tuple[tuple[int, ...], tuple[object, ...], dict[str, object]]:
        """(grid, arguments, launch options) of one launch with a fixed (BV, num_warps) tile."""
        bv = min(tile[0], self.shape["BDV"])
        grid = (cdiv(self.shape["DV"], bv), self.shape["HV"], self.batch)
        args = (*self.tensors, *self.workspace, *self.scalars, *self.shape.values(), bv)
        return grid, args, launch_options(tile)

    def launch(self, tile: Tile) -> None:
        """One launch, through the compiled handle after its first."""
        grid, args, options = self.arguments(tile)
        _step_launch(grid, *args, **options)

    def tune_on_scratch(self, shape: dict[str, int], bucket: int) -> Tile:
        """Autotunes on ``bucket`` fresh rows of both states: benchmarking runs the in-place step
        many times, which must never touch live state. Returns the (BV, num_warps) tile it chose."""
        x, cw, conv_state, z, a, b, A_log, dt_bias, nw, state, slots, _ = self.tensors
        device = state.device
        rows = torch.arange(bucket, device=device) % x.shape[0]
        scratch_x, scratch_z = x[rows].contiguous(), z[rows].contiguous()
        scratch_a, scratch_b = a[rows].contiguous(), b[rows].contiguous()
        scratch_cs = torch.zeros((bucket, *conv_state.shape[1:]), dtype=conv_state.dtype, device=device)
        scratch_state = torch.zeros((bucket, *state.shape[1:]), dtype=state.dtype, device=device)
        scratch_slots = torch.arange(bucket, dtype=slots.dtype, device=device)
        scratch_y = torch.empty((bucket, *self.tensors[-1].shape[1:]), dtype=x.dtype, device=device)
        tensors = [scratch_x, cw, scratch_cs, scratch_z, scratch_a, scratch_b, A_log, dt_bias, nw]
        tensors += [scratch_state, scratch_slots, scratch_y]
        strides = [
            t.stride(0) for t in (scratch_x, scratch_cs, scratch_z, scratch_a, scratch_b, scratch_state)
        ]
        _tuned_kernel[lambda meta: (cdiv(shape["DV"], meta["BV"]), shape["HV"], bucket)](
            *tensors,
            *self.workspace,
            *strides,
            *self.scalars[-3:],
            **shape,
            USE_PDL=pdl_enabled(),
            launch_pdl=pdl_enabled(),
        )
        best = _tuned_kernel.best_config
        return best.kwargs["BV"], best.num_warps


BoundGdnStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bind_gdn_decode_step(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> BoundGdnStep | None:
    """The split path of ``gdn_decode_step`` bound to one layer's weights and states and to the
    layout of these inputs: a function of (mixed_qkv, z, a, b, state_slots) -> y that allocates
    the conv's output and y and launches both kernels through ``FastLaunch.bind``. None where no
    binding applies: the fused path, inputs the general path would copy first, a bucket whose
    tile is not tuned yet (bind after the op's first call)."""
    batch, channels = mixed_qkv.shape
    if GDN_PATH == "fused" or conv_weight.dim() != 2 or not conv_weight.is_contiguous():
        return None
    if mixed_qkv.stride(-1) != 1 or batch == 0:
        return None
    conv_out = torch.empty((batch, channels), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    conv_grid, conv_args, conv_options = conv_decode_arguments(
        mixed_qkv, conv_weight, conv_state, state_slots, conv_out
    )
    step = _Step.build(
        conv_out,
        conv_weight,
        conv_state,
        z,
        a,
        b,
        A_log,
        dt_bias,
        norm_weight,
        eps,
        state,
        state_slots,
        False,
    )
    if step.tensors[3] is not z or step.tensors[4] is not a or step.tensors[5] is not b:
        return None
    tile = INTERPRET_TILE if _INTERPRET else TUNED.tiles.get(step.key)
    if tile is None:
        return None
    y = step.tensors[-1]
    grid, args, options = step.arguments(tile)
    conv = conv_decode_launch.bind(conv_grid, conv_args, (mixed_qkv, state_slots, conv_out), **conv_options)
    launch = _step_launch.bind(grid, args, (conv_out, z, a, b, state_slots, y), **options)
    dtype, device, y_shape = mixed_qkv.dtype, mixed_qkv.device, y.shape

    def bound(
        mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state_slots: torch.Tensor
    ) -> torch.Tensor:
        conv_out = torch.empty((batch, channels), dtype=dtype, device=device)
        conv(mixed_qkv, state_slots, conv_out)
        y = torch.empty(y_shape, dtype=dtype, device=device)
        launch(conv_out, z, a, b, state_slots, y)
        return y

    return bound


def gdn_decode_step_triton(mixed_qkv: torch.Tensor, *args: Any) -> torch.Tensor:
    """``gdn_decode_step`` (signature in ``kernels/gdn_step.py``): the split path, or the fused kernel
    with ``PHALANX_GDN=fused``. One path at every batch, so eager decode and graphs agree."""
    if GDN_PATH == "fused":
        return gdn_decode_step_fused(mixed_qkv, *args)
    return gdn_decode_step_split(mixed_qkv, *args)
