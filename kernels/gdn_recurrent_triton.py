"""The Gated DeltaNet decode step at every batch size: three kernels, the recurrence split over dv.

At high batch the decode step is bound by the fp32 recurrent state it streams (2 MiB per request
and layer at the 4B geometry, read once and written once); at low batch by how few programs share
the work. The fused step kernel (``kernels/gdn_step_triton.py``) gives one program a whole
[dk, dv] state and several value heads: too few bytes in flight for the copy bandwidth, and only
Hk programs at batch 1. Here the step is:

1. ``causal_conv1d_decode_triton``: conv + SiLU of every qkv channel once (the conv state is
   shifted exactly once per channel), stored in the model dtype as the unfused chain stores it;
2. ``_recurrent_kernel``: grid (dv / BV, Hv, batch); each program owns a [dk, BV] fp32 state
   tile, recomputes its key head's q/k L2 norms (cheap) and the gates, runs the delta-rule step
   and stores o in the model dtype. BV and num_warps are autotuned per batch bucket;
3. ``gated_rms_norm_triton`` over dv.

Rows are independent (every row reads and writes only its own state slot), so graph padding rows
on free slots are harmless; launch parameters come from shapes only (graph-capturable).
"""

from __future__ import annotations

import inspect
import math
import os

import structlog
import torch
import triton
import triton.language as tl

from kernels.conv1d_triton import causal_conv1d_decode_triton
from kernels.gdn_step import gdn_split_sizes
from kernels.gdn_triton import l2_normalize, softplus_gate
from kernels.launch import FastLaunch, cdiv, next_pow2, pdl_enabled, wait_for_producer
from kernels.norms_triton import gated_rms_norm_triton
from kernels.parallel_compile import precompiling

log = structlog.get_logger(__name__)

# (BV, num_warps): at dk = 128 every config holds 16..64 fp32 state elements per thread (more
# would spill); narrow tiles make more, smaller programs, wide ones fewer reductions per byte.
_TUNING_SPACE = (
    (8, 1),
    (8, 2),
    (16, 1),
    (16, 2),
    (16, 4),
    (32, 2),
    (32, 4),
    (32, 8),
    (64, 4),
    (64, 8),
    (128, 8),
)
# For a shape first met inside a CUDA-graph capture with no tuned neighbour.
DEFAULT_BV = 32
DEFAULT_WARPS = 4
# Under TRITON_INTERPRET=1 (no timing): narrow, so the CPU tests' dv = 32 spans two programs.
INTERPRET_TILE = (16, 4)
# Tuning runs on scratch state rows (never on live state); batches above this reuse its choice,
# which bounds the scratch at MAX_TUNING_ROWS requests' state (128 MiB at the 4B geometry).
MAX_TUNING_ROWS = 64


# tuning_bucket only keys the autotuner: unspecialised, bucket 1 compiles the same binary as 64.
@triton.jit(do_not_specialize=["tuning_bucket"])
def _recurrent_kernel(
    conv_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dt_ptr,
    state_ptr,
    slots_ptr,
    o_ptr,
    stride_conv,
    stride_a,
    stride_b,
    stride_slot,
    scale,
    tuning_bucket,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_producer(USE_PDL)
    vb = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    kh = h // (HV // HK)
    dk = tl.arange(0, BK)
    dv = vb * BV + tl.arange(0, BV)
    k_mask = dk < DK
    v_mask = dv < DV
    s_mask = k_mask[:, None] & v_mask[None, :]
    slot = tl.load(slots_ptr + row)
    s_ptrs = state_ptr + slot * stride_slot + h * DK * DV + dk[:, None] * DV + dv[None, :]
    # The state is streamed once per step: keep it from evicting the q/k/v rows other programs share.
    s = tl.load(s_ptrs, mask=s_mask, other=0.0, eviction_policy="evict_first")
    conv_row = conv_ptr + row * stride_conv
    q = tl.load(conv_row + kh * DK + dk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(conv_row + HK * DK + kh * DK + dk, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(conv_row + 2 * HK * DK + h * DV + dv, mask=v_mask, other=0.0).to(tl.float32)
    q = l2_normalize(q, scale)
    k = l2_normalize(k, 1.0)
    a = tl.load(a_ptr + row * stride_a + h).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + h).to(tl.float32)
    g = softplus_gate(a, tl.load(dt_ptr + h).to(tl.float32), tl.load(alog_ptr + h).to(tl.float32))
    beta = tl.sigmoid(b)
    s = s * tl.exp(g)
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    # Threads sharing an element (a tile smaller than the program) must all have read it first.
    tl.debug_barrier()
    tl.store(s_ptrs, s, mask=s_mask, eviction_policy="evict_first")
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + (row * HV + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=v_mask)


def _prune_configs(
    configs: list[triton.Config], named_args: dict[str, object], **kwargs: object
) -> list[triton.Config]:
    """Drops tiles wider than dv (all-masked columns), keeping at least the narrowest."""
    dv = int(kwargs.get("DV", named_args.get("DV", 0)))
    fitting = [c for c in configs if c.kwargs["BV"] <= next_pow2(dv)]
    return fitting or [min(configs, key=lambda c: c.kwargs["BV"])]


def _short_bench(fn: object, quantiles: tuple[float, ...]) -> list[float]:
    # A few ms per config: the sweep tunes up to 11 configs for each tuning bucket.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


# Older Triton releases have no do_bench hook; they then bench with their defaults (slower sweep).
_BENCH = {"do_bench": _short_bench} if "do_bench" in inspect.signature(triton.autotune).parameters else {}
_tuned_kernel = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w) for bv, w in _TUNING_SPACE],
    key=["tuning_bucket", "HK", "HV", "DK", "DV"],
    prune_configs_by={"early_config_prune": precompiling(_recurrent_kernel, _prune_configs)},
    **_BENCH,
)(_recurrent_kernel)
# Tuned launches go through the compiled handle: the autotuner's per-call dispatch costs eager
# decode tens of µs a layer.
_recurrent_launch = FastLaunch(_recurrent_kernel, pdl=True)

# Tuning keys already benchmarked (on scratch rows), with the (BV, num_warps) each chose.
TUNED_TILES: dict[tuple[object, ...], tuple[int, int]] = {}
_untuned_in_capture_logged: set[tuple[object, ...]] = set()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def tuning_bucket(batch: int) -> int:
    """The autotuning key's batch: the graph bucket (power of two), capped at MAX_TUNING_ROWS."""
    return min(next_pow2(max(batch, 1)), MAX_TUNING_ROWS)


def check_step_states(conv_state: torch.Tensor, state: torch.Tensor, conv_dim: int, kernel: int) -> None:
    """The decode step's layout contract for both states (raises ValueError with the shapes)."""
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError(f"recurrent state must be contiguous float32, got {state.dtype} {state.stride()}")
    if not conv_state.is_contiguous() or conv_state.shape[1:] != (conv_dim, kernel - 1):
        raise ValueError(
            f"conv_state must be contiguous [slots, {conv_dim}, {kernel - 1}], got {tuple(conv_state.shape)}"
        )


def recurrent_decode(
    conv_out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    key_heads: int,
) -> torch.Tensor:
    """o [B, Hv, dv] (conv_out's dtype) from the conv outputs [B, 2*Hk*dk + Hv*dv]; state in place."""
    batch = conv_out.shape[0]
    _, hv, dk, dv = state.shape
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    o = torch.empty((batch, hv, dv), dtype=conv_out.dtype, device=conv_out.device)
    if batch == 0:
        return o
    args = [conv_out, a, b, A_log, dt_bias, state, state_slots, o]
    scalars = [conv_out.stride(0), a.stride(0), b.stride(0), state.stride(0), dk**-0.5]
    shape = dict(HK=key_heads, HV=hv, DK=dk, DV=dv, BK=next_pow2(dk))
    bucket = tuning_bucket(batch)
    if _interpreting():
        _launch_fixed(args, scalars, bucket, shape, batch, INTERPRET_TILE)
        return o
    # Triton's autotuner keys on the named arguments plus every tensor argument's dtype: this key
    # must hit exactly when Triton's does, or Triton would benchmark on the live state.
    key = (bucket, key_heads, hv, dk, dv, *(t.dtype for t in args), state.device)
    tile = TUNED_TILES.get(key)
    if tile is None:
        if torch.cuda.is_current_stream_capturing():
            tile = _tile_for_capture(key)
        else:
            tile = _tune_on_scratch(key, args, scalars, bucket, shape)
    _launch_fixed(args, scalars, bucket, shape, batch, tile)
    return o


def _tile_for_capture(key: tuple[object, ...]) -> tuple[int, int]:
    """A tile for a batch bucket first met inside a graph capture, where benchmarking would break
    the capture: the tile tuned for the nearest bucket of the same heads (its kernel is already
    compiled), else the default one."""
    nearest = sorted(
        (abs(math.log2(k[0]) - math.log2(key[0])), k[0], tile)
        for k, tile in TUNED_TILES.items()
        if k[1:] == key[1:]
    )
    tile = nearest[0][2] if nearest else (DEFAULT_BV, DEFAULT_WARPS)
    if key not in _untuned_in_capture_logged:
        _untuned_in_capture_logged.add(key)
        log.warning("gdn recurrent kernel untuned at graph capture", bucket=key[0], heads=key[1:3], tile=tile)
    return tile


def _launch_fixed(
    args: list[torch.Tensor],
    scalars: list[object],
    bucket: int,
    shape: dict[str, int],
    batch: int,
    tile: tuple[int, int],
) -> None:
    """One launch with a fixed (BV, num_warps) tile, through the compiled handle after its first."""
    bv = min(tile[0], next_pow2(shape["DV"]))
    grid = (cdiv(shape["DV"], bv), shape["HV"], batch)
    # The launch options exactly as the autotuner passes them, so a tuned tile's binary is reused.
    options = triton.Config({}, num_warps=tile[1]).all_kwargs()
    _recurrent_launch(grid, *args, *scalars, bucket, *shape.values(), bv, **options)


def _tune_on_scratch(
    key: tuple[object, ...],
    args: list[torch.Tensor],
    scalars: list[object],
    bucket: int,
    shape: dict[str, int],
) -> tuple[int, int]:
    """Autotunes on ``bucket`` fresh state rows: benchmarking runs the in-place step many times,
    which must never touch live state. Returns the (BV, num_warps) tile it chose."""
    conv_out, a, b, A_log, dt_bias, state, _, _ = args
    rows = torch.arange(bucket, device=state.device) % conv_out.shape[0]
    scratch_state = torch.zeros((bucket, *state.shape[1:]), dtype=state.dtype, device=state.device)
    slots = torch.arange(bucket, dtype=args[6].dtype, device=state.device)
    scratch_o = torch.empty((bucket, shape["HV"], shape["DV"]), dtype=conv_out.dtype, device=state.device)
    scratch = [conv_out[rows].contiguous(), a[rows].contiguous(), b[rows].contiguous(), A_log, dt_bias]
    scratch_scalars = [
        scratch[0].stride(0),
        scratch[1].stride(0),
        scratch[2].stride(0),
        scratch_state.stride(0),
    ]

    def grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (cdiv(shape["DV"], meta["BV"]), shape["HV"], bucket)

    _tuned_kernel[grid](
        *scratch,
        scratch_state,
        slots,
        scratch_o,
        *scratch_scalars,
        scalars[-1],
        bucket,
        **shape,
        USE_PDL=pdl_enabled(),
        launch_pdl=pdl_enabled(),
    )
    best = _tuned_kernel.best_config
    TUNED_TILES[key] = (best.kwargs["BV"], best.num_warps)
    log.info(
        "gdn recurrent kernel tuned",
        bucket=bucket,
        heads=(shape["HK"], shape["HV"]),
        tile=TUNED_TILES[key],
    )
    return TUNED_TILES[key]


def gdn_decode_step_split(
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
) -> torch.Tensor:
    """``gdn_decode_step`` (kernels/gdn_step.py) as conv, split recurrence and gated norm."""
    conv_dim = mixed_qkv.shape[1]
    hk, _, _, _ = gdn_split_sizes(conv_dim, state)
    kernel = conv_weight.shape[-1]
    check_step_states(conv_state, state, conv_dim, kernel)
    conv_out = causal_conv1d_decode_triton(
        mixed_qkv, conv_weight.reshape(conv_dim, kernel), conv_state, state_slots
    )
    o = recurrent_decode(conv_out, a, b, A_log, dt_bias, state, state_slots, hk)
    return gated_rms_norm_triton(o, z, norm_weight, eps)
