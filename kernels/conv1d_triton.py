"""Triton depthwise causal conv1d (+ SiLU) over the GDN qkv channels, decode and prefill.

Same signatures and semantics as ``kernels/conv1d.py``. The conv state holds the last K-1 raw
(pre-conv) inputs per channel, oldest first: ``conv_state[slot, c, j]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, wait_for_producer
from phalanx.kernels.varlen import Varlen


@triton.jit
def conv_state_window(state_rows, tap, mask, K: tl.constexpr):
    """The [C, TAPS] views of the stored conv inputs of channels ``state_rows`` (one pointer per
    channel, to its K - 1 stored inputs, oldest first): ``old[:, j]`` is stored input j, ``later``
    the same shifted left by one (input j + 1), for ``conv_step``. TAPS = K rounded up to a power
    of two; columns past the stored inputs are zero."""
    stored = mask[:, None] & (tap < K - 1)[None, :]
    old = tl.load(state_rows[:, None] + tap[None, :], mask=stored, other=0.0)
    later = tl.load(
        state_rows[:, None] + 1 + tap[None, :], mask=mask[:, None] & (tap < K - 2)[None, :], other=0.0
    )
    return old, later


@triton.jit
def store_conv_state(state_rows, shifted, mask, tap, K: tl.constexpr):
    """Writes ``conv_step``'s new stored inputs back to the channels ``state_rows``."""
    stored = mask[:, None] & (tap < K - 1)[None, :]
    tl.store(state_rows[:, None] + tap[None, :], shifted.to(state_rows.dtype.element_ty), mask=stored)


@triton.jit
def conv_step(old, later, x, w, tap, K: tl.constexpr):
    """One decode step of depthwise causal conv + SiLU from ``conv_state_window``'s views, the new
    inputs x [C] and the weights w [C, TAPS]: (silu(conv) in fp32, the new stored inputs [C, TAPS],
    i.e. the window shifted left by one with x last)."""
    window = tl.where((tap == K - 1)[None, :], x[:, None], old)
    acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    shifted = tl.where((tap == K - 2)[None, :], x[:, None], later)
    return acc * tl.sigmoid(acc), shifted


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    slots_ptr,
    y_ptr,
    C,
    stride_x,
    stride_y,
    stride_slot,
    K: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One decode step of BLOCK_C channels of one row, as [BLOCK_C, TAPS] tiles (TAPS = K rounded
    up to a power of two): the state, its copy shifted by one tap, the weights and x are all loaded
    at once, so the step costs one round trip to memory and one barrier, not one per tap.

    The slot, the stored inputs and the weights are read before the wait for the kernel before
    this one (under PDL still draining): that kernel writes none of them. The stored inputs were
    last written by this layer's conv in an earlier step, and a slot copy or prefill that touched
    them ran before that kernel started (see ``kernels/gdn_step_triton.py``)."""
    b = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    tap = tl.arange(0, TAPS)
    slot = tl.load(slots_ptr + b)
    state_rows = state_ptr + slot * stride_slot + ch * (K - 1)
    old, later = conv_state_window(state_rows, tap, mask, K)
    w = tl.load(w_ptr + ch[:, None] * K + tap[None, :], mask=mask[:, None] & (tap < K)[None, :], other=0.0)
    wait_for_producer(USE_PDL)
    x = tl.load(x_ptr + b * stride_x + ch, mask=mask, other=0.0)
    y, shifted = conv_step(old, later, x, w, tap, K)
    # Another thread may hold the old value of an element this thread overwrites: all reads first.
    tl.debug_barrier()
    store_conv_state(state_rows, shifted, mask, tap, K)
    tl.store(y_ptr + b * stride_y + ch, y.to(y_ptr.dtype.element_ty), mask=mask)


# Channels per decode program: 32 programs a row at the 4B geometry's 8192 channels, so batch 1
# spreads over 32 SMs and batch 64 over 2048 programs.
_DECODE_BLOCK_C = 256
conv_decode_launch = FastLaunch(_conv_decode_kernel, pdl=True)


def _check_state(conv_state: torch.Tensor, channels: int, kernel: int) -> None:
    if not conv_state.is_contiguous() or conv_state.shape[1:] != (channels, kernel - 1):
        raise ValueError(
            f"conv_state must be contiguous [slots, {channels}, {kernel - 1}], "
            f"got shape {tuple(conv_state.shape)} strides {conv_state.stride()}"
        )


def causal_conv1d_decode_triton(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    batch, channels = x.shape
    kernel = weight.shape[1]
    _check_state(conv_state, channels, kernel)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    y = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    grid, args, options = conv_decode_arguments(x, weight, conv_state, state_slots, y)
    conv_decode_launch(grid, *args, **options)
    return y


def conv_decode_arguments(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    y: torch.Tensor,
) -> tuple[tuple[int, int], tuple[object, ...], dict[str, int]]:
    """(grid, arguments, launch options) of the decode conv on checked, contiguous tensors."""
    batch, channels = x.shape
    kernel = weight.shape[1]
    block = min(_DECODE_BLOCK_C, next_pow2(channels))
    args = (
        x,
        weight,
        conv_state,
        state_slots,
        y,
        channels,
        x.stride(0),
        y.stride(0),
        conv_state.stride(0),
        kernel,
        next_pow2(kernel),
        block,
    )
    return (batch, cdiv(channels, block)), args, {"num_warps": 4}


@triton.jit
def _tap_in_chunk(x_ptr, w_ptr, t, ch, bos, tile_mask, c_mask, stride_x, j, K: tl.constexpr):
    """Tap j of tokens t: the channels' weights, and the inputs (fp32) it reads, zero where the tap
    falls before the token's chunk (``bos``, its first token) or before the batch."""
    source = t - (K - 1) + j
    w = tl.load(w_ptr + ch * K + j, mask=c_mask, other=0.0).to(tl.float32)
    xv = tl.load(
        x_ptr + source[:, None] * stride_x + ch[None, :], mask=(source >= 0)[:, None] & tile_mask, other=0.0
    )
    return w, tl.where((source >= bos)[:, None], xv.to(tl.float32), 0.0)


# The token and chunk counts change with every batch; specialised on them (1, a multiple of 16)
# the kernels would compile anew mid-serving for batch shapes that startup did not meet.
@triton.jit(do_not_specialize=["T"])
def _conv_prefill_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    slots_ptr,
    cu_ptr,
    init_ptr,
    chunk_of_ptr,
    y_ptr,
    T,
    C,
    stride_x,
    stride_y,
    stride_slot,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """conv + SiLU of BLOCK_T tokens by BLOCK_C channels. The x rows' addresses need no chunk
    bounds, so their loads go out with the tokens' chunk starts, not after them; a tap before its
    chunk's start is zeroed. Only a tile holding one of a chunk's first K - 1 tokens, in a chunk
    that continues a stored state, gathers stored conv inputs: that gather is a scalar load per
    element and tap (the state is [C, K - 1] per slot), more instructions than the x loads of any
    tile, and at prefill sizes one tile in hundreds needs it. That tile sums its taps as
    ``w * (x + stored)`` in tap order, the others ``w * x``: the same sums either way."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = t < T
    c_mask = ch < C
    tile_mask = t_mask[:, None] & c_mask[None, :]
    chunk = tl.load(chunk_of_ptr + t, mask=t_mask, other=0)
    bos = tl.load(cu_ptr + chunk, mask=t_mask, other=0)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        w, xv = _tap_in_chunk(x_ptr, w_ptr, t, ch, bos, tile_mask, c_mask, stride_x, j, K)
        acc += w[None, :] * xv
    near_start = t_mask & (t - bos < K - 1)
    from_state = near_start & (tl.load(init_ptr + chunk, mask=near_start, other=0) != 0)
    if tl.max(from_state.to(tl.int32), axis=0) > 0:
        slot = tl.load(slots_ptr + chunk, mask=from_state, other=0)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):
            w, xv = _tap_in_chunk(x_ptr, w_ptr, t, ch, bos, tile_mask, c_mask, stride_x, j, K)
            local = t - bos - (K - 1) + j  # the tap's position inside the chunk
            stored = (from_state & (local < 0))[:, None] & c_mask[None, :]
            sv = tl.load(
                state_ptr + slot[:, None] * stride_slot + ch[None, :] * (K - 1) + ((K - 1) + local)[:, None],
                mask=stored,
                other=0.0,
            )
            acc += w[None, :] * (xv + sv.to(tl.float32))
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t[:, None] * stride_y + ch[None, :], y.to(y_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit(do_not_specialize=["n_chunks"])
def _conv_prefill_state_kernel(
    x_ptr,
    state_ptr,
    slots_ptr,
    cu_ptr,
    init_ptr,
    capture_ends_ptr,
    capture_slots_ptr,
    n_chunks,
    C,
    stride_x,
    stride_slot,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program i < n_chunks writes chunk i's last K-1 raw inputs; for chunks shorter than K-1 the
    older columns come from the previous state (or zeros without one). Program n_chunks + j takes
    state capture j: the K-1 inputs before batch token ``capture_ends[j]``, into its slot."""
    i = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = ch < C
    if i < n_chunks:
        end = tl.load(cu_ptr + i + 1).to(tl.int32)
        length = end - tl.load(cu_ptr + i).to(tl.int32)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        init = tl.load(init_ptr + i).to(tl.int32)
    else:
        end = tl.load(capture_ends_ptr + i - n_chunks).to(tl.int32)
        length = end * 0 + (K - 1)  # a capture lies 64 or more tokens into its chunk
        slot = tl.load(capture_slots_ptr + i - n_chunks).to(tl.int64)
        init = end * 0
    # Scalars broadcast to the channel vector: masks must be vectors for the interpreter.
    zero = tl.zeros((BLOCK_C,), dtype=tl.int32)
    has_init = (zero + init) != 0
    row = state_ptr + slot * stride_slot + ch * (K - 1)
    # New column j reads old column j + length > j, so ascending order never reads a column it
    # already overwrote; the barrier keeps threads that share a channel in step.
    for j in tl.static_range(K - 1):
        local = zero + (length - (K - 1) + j)
        xv = tl.load(x_ptr + (end - (K - 1) + j) * stride_x + ch, mask=c_mask & (local >= 0), other=0.0)
        sv = tl.load(row + (K - 1) + local, mask=c_mask & (local < 0) & has_init, other=0.0)
        tl.debug_barrier()
        tl.store(row + j, xv.to(state_ptr.dtype.element_ty) + sv, mask=c_mask)


# (tokens, channels) of a prefill conv program: the fastest of the tiles tried on the H200 for 4,096
# fresh tokens and sixteen 512-token prompts (docs/benchmarks/kernel-choices-h200.md).
PREFILL_TILE = (32, 128)
# A prefill launches these once per linear-attention layer: the cheaper launch path (kernels/launch.py).
_conv_prefill_launch = FastLaunch(_conv_prefill_kernel)
_conv_prefill_state_launch = FastLaunch(_conv_prefill_state_kernel)


def causal_conv1d_prefill_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    varlen: Varlen | None = None,
) -> torch.Tensor:
    """``causal_conv1d_prefill_ref``, and ``varlen``'s state captures taken in the same launch as
    the chunks' final states (``capture_conv_states``)."""
    tokens, channels = x.shape
    kernel = weight.shape[1]
    _check_state(conv_state, channels, kernel)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    device = x.device
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    init = has_initial_state.to(device=device)  # bool or integer: the kernels test it against 0
    slots = state_slots.to(device=device)
    n_chunks = cu.shape[0] - 1
    y = torch.empty((tokens, channels), dtype=x.dtype, device=device)
    if tokens == 0 or n_chunks == 0:
        return y
    if varlen is not None:
        chunk_of = varlen.chunk_of_token
    else:
        chunk_of = torch.searchsorted(
            cu[1:], torch.arange(tokens, device=device, dtype=torch.int32), right=True
        )
        chunk_of = chunk_of.to(torch.int32)
    block_t, block_c = PREFILL_TILE
    grid = (cdiv(tokens, block_t), cdiv(channels, block_c))
    _conv_prefill_launch(
        grid,
        x,
        weight,
        conv_state,
        slots,
        cu,
        init,
        chunk_of,
        y,
        tokens,
        channels,
        x.stride(0),
        y.stride(0),
        conv_state.stride(0),
        kernel,
        block_t,
        block_c,
        num_warps=4,
    )
    captures = varlen.captures if varlen is not None else None
    _conv_prefill_state_launch(
        (n_chunks + (len(captures.chunks) if captures else 0), cdiv(channels, 1024)),
        x,
        conv_state,
        slots,
        cu,
        init,
        captures.token_ends if captures else cu,
        captures.slots if captures else slots,
        n_chunks,
        channels,
        x.stride(0),
        conv_state.stride(0),
        kernel,
        1024,
        num_warps=4,
    )
    return y
