"""The greedy pick (``kernels/greedy.py``) on CUDA: one PDL kernel for the argmax and the fed write.

At the end of a decode graph ``torch.argmax`` and ``index_copy_`` were two kernels launched
without PDL, each waiting for the one before to end. Here grid (rows, splits): each program scans
``CHUNK`` logits of one row in vector lanes (a lane keeps its first maximum, comparing strictly as
indices grow), reduces the lanes to the chunk's first maximum and stores it as a partial; the
program that arrives last for its row reduces the partials the same way (largest value, then the
smallest index), stores the token and writes it to ``fed`` at the row's slot, and resets the row's
counter. The answer does not depend on which program arrives last, so a graph replay equals the
eager launch bit for bit.

With a landing (``kernels/greedy.py``), the last program of each row also stores its token into
the pinned ring over PCIe, and row 0's the step's number beside them (read before the PDL wait:
in a decode graph the first kernel stores it, ``kernels/host_staging_triton.py``).

NaN counts as the largest value, as in ``torch.argmax``; where a row holds both NaN and +inf this
picks the first of either, torch the first NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, cdiv, next_pow2, wait_for_producer
from phalanx.kernels.workspace import GrowOnlyWorkspace

# Logits a program scans (248,320 of the Qwen3.5 vocabulary: 61 programs a row) and per loop step.
CHUNK = 4096
_BLOCK = 1024
_WARPS = 4
# Sized for at least the largest decode graph bucket, so that a capture never grows it.
_MIN_WORKSPACE_ROWS = 256
_WORKSPACE = GrowOnlyWorkspace(
    "greedy pick workspace", (torch.float32, torch.int32, torch.int32), (False, False, True)
)


@triton.jit
def _greedy_kernel(
    logits_ptr, slots_ptr, tokens_ptr, fed_ptr, part_val_ptr, part_idx_ptr, arrivals_ptr, seq_ptr,
    landing_ptr, vocab, stride_row, stride_landing,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    LAND: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr + row)  # staged by the graph's first kernel, long finished
    landing_half = landing_ptr
    seq = 0
    if LAND:  # stored by the graph's first kernel too
        seq = tl.load(seq_ptr)
        landing_half = landing_ptr + (seq % 2) * stride_landing
    wait_for_producer(USE_PDL)
    lanes = tl.arange(0, BLOCK)
    start = split * CHUNK
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = start + lanes  # a lane that never sees more than -inf answers its first index
    for offset in range(0, CHUNK, BLOCK):
        idx = start + offset + lanes
        v = tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)
        take = v > best
        best = tl.where(take, v, best)
        best_idx = tl.where(take, idx, best_idx)
    top, token = _first_max(best, best_idx, vocab)
    if SPLITS == 1:
        _store_token(tokens_ptr, fed_ptr, row, slot, token, landing_half, seq, LAND)
        return
    tl.store(part_val_ptr + row * SPLITS + split, top)
    tl.store(part_idx_ptr + row * SPLITS + split, token)
    tl.debug_barrier()  # the partial is stored before the counter says so
    counter = arrivals_ptr + row
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        s = tl.arange(0, SPLITS_PAD)
        parts = row * SPLITS + s
        # .cg: from L2, where the other programs' partials are, never from this SM's L1.
        vals = tl.load(part_val_ptr + parts, mask=s < SPLITS, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + parts, mask=s < SPLITS, other=vocab, cache_modifier=".cg")
        _, token = _first_max(vals, idxs, vocab)
        _store_token(tokens_ptr, fed_ptr, row, slot, token, landing_half, seq, LAND)
        tl.store(counter, 0)


@triton.jit
def _first_max(values, indices, vocab):
    """The largest of ``values`` and the smallest of the indices that hold it."""
    top = tl.max(values, axis=0)
    return top, tl.min(tl.where(values == top, indices, vocab), axis=0)


@triton.jit
def _store_token(tokens_ptr, fed_ptr, row, slot, token, landing_half, seq, LAND: tl.constexpr):
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(fed_ptr + slot, token.to(tl.int64))
    if LAND:
        # .wt: straight through to host memory, as the staging kernel's acknowledgement
        tl.store(landing_half + 1 + row, token.to(tl.int64), cache_modifier=".wt")
        if row == 0:
            tl.store(landing_half, seq, cache_modifier=".wt")


_launch = FastLaunch(_greedy_kernel, pdl=True)


def greedy_pick_triton(
    logits: torch.Tensor,
    slots: torch.Tensor,
    fed: torch.Tensor,
    landing: torch.Tensor | None = None,
    seq: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """``greedy_pick_ref``'s contract; ``chunk`` (a power of two) is the logits per program."""
    rows, vocab = logits.shape
    land = landing is not None and seq is not None
    if land and (landing.shape[0] != 2 or landing.shape[1] < 1 + rows or landing.stride(1) != 1):
        raise ValueError(f"greedy pick: landing {tuple(landing.shape)} is not a [2, 1 + {rows}] ring")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if slots.shape != (rows,) or slots.dtype != torch.int64 or fed.dtype != torch.int64:
        raise ValueError(
            f"greedy pick: slots {tuple(slots.shape)} {slots.dtype} and fed {fed.dtype} must be "
            f"int64, one slot per row of the {rows} logit rows"
        )
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    splits = cdiv(vocab, chunk)
    workspace_rows = max(rows, _MIN_WORKSPACE_ROWS)
    part_val, part_idx, arrivals = _WORKSPACE.get(
        logits.device,
        (workspace_rows * splits, workspace_rows * splits, workspace_rows),
        needed_for=f"{rows} rows of {vocab} logits",
    )
    seq_word, ring = (seq, landing) if land else (tokens, tokens)  # unread without a landing
    _launch(
        (rows, splits), logits, slots, tokens, fed, part_val, part_idx, arrivals, seq_word, ring, vocab,
        logits.stride(0), ring.stride(0), chunk, min(_BLOCK, chunk), splits, next_pow2(splits), land,
        num_warps=_WARPS,
    )  # fmt: skip
    return tokens
