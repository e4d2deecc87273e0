"""The token embedding (``kernels/embedding.py``) as one Triton kernel, launched with PDL.

In a decode graph the embedding sits between the step's index kernels and the first layer's
in_proj. torch's gather there was a kernel that never lets its dependent start early, so in_proj
could request its first weight tile only after the gather had ended; this kernel lets it start
right away, and at TP > 1 it also replaces the five torch ops that zero another rank's tokens
(measured: docs/benchmarks/kernel-choices-h200.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.launch import FastLaunch, cdiv, wait_for_producer

_BLOCK = 1024  # hidden elements per program


@triton.jit
def _embedding_kernel(
    tokens_ptr, w_ptr, out_ptr, vocab_start, V, H, stride_w,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < H
    wait_for_producer(USE_PDL)  # the tokens are the step's staged rows
    # The row index, one per element: a vector mask is what every backend (and the interpreter) takes.
    local = tl.load(tokens_ptr + row) - vocab_start + tl.zeros([BLOCK], dtype=tl.int64)
    inside = (local >= 0) & (local < V)
    safe = tl.where(inside, local, 0)
    values = tl.load(w_ptr + safe * stride_w + cols, mask=col_mask & inside, other=0.0)
    tl.store(out_ptr + row * H + cols, values, mask=col_mask)


_embedding_launch = FastLaunch(_embedding_kernel, pdl=True)


def embedding_triton(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """``embedding_ref``'s contract, one launch."""
    rows, (vocab, hidden) = tokens.shape[0], weight.shape
    out = torch.empty((rows, hidden), dtype=weight.dtype, device=weight.device)
    if rows:
        if weight.stride(1) != 1:
            raise ValueError(
                f"embedding weight {tuple(weight.shape)} needs contiguous rows, strides {weight.stride()}"
            )
        _embedding_launch(
            (rows, cdiv(hidden, _BLOCK)),
            tokens,
            weight,
            out,
            vocab_start,
            vocab,
            hidden,
            weight.stride(0),
            _BLOCK,
            num_warps=4,
        )
    return out
