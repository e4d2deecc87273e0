"""KV addresses past 2^31 elements, on CPU under ``TRITON_INTERPRET=1``.

A KV pool sized to a GPU's memory holds more than 2^31 elements per layer (the 4B geometry passes
it at 131,072 pages of 16 tokens), and the padding page sits at the pool's end. The attention
kernels' address helper is run here on page ids whose offsets lie past 2^31 and 2^32, and its
offsets compared with exact integer arithmetic; no memory that far is touched. The interpreter
computes int32 products in int32, so 32-bit arithmetic wraps here as it would on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton
import triton.language as tl

from phalanx.kernels.attention_triton import _kv_offsets
from tests.support.interpreter_checks import assert_within, report, run_interpreted

PAGE = 16
KV_HEADS, HEAD_DIM = 4, 256  # the 4B geometry's cache page: [PAGE, KV_HEADS, HEAD_DIM]


@triton.jit
def _offsets_kernel(pt_ptr, out_ptr, n_pos, stride_page, stride_tok, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    pos = tl.arange(0, BLOCK)
    d = tl.arange(0, 2)
    offsets = _kv_offsets(pt_ptr, pos, pos < n_pos, stride_page, stride_tok, d, PAGE=PAGE)
    tl.store(out_ptr + pos[:, None] * 2 + d[None, :], offsets, mask=(pos < n_pos)[:, None])


def check_kv_offsets_past_2_31() -> dict[str, float]:
    stride_tok = KV_HEADS * HEAD_DIM
    stride_page = PAGE * stride_tok
    # Page ids just under and over 2^31 / stride_page, and far past 2^32 elements.
    pages = [3, (1 << 31) // stride_page - 1, (1 << 31) // stride_page + 5, (1 << 33) // stride_page + 7]
    table = torch.tensor(pages, dtype=torch.int32)
    positions = torch.arange(len(pages) * PAGE)
    out = torch.zeros(len(positions), 2, dtype=torch.int64)
    _offsets_kernel[(1,)](table, out, len(positions), stride_page, stride_tok, PAGE=PAGE, BLOCK=64)
    expected = [
        [pages[p // PAGE] * stride_page + (p % PAGE) * stride_tok + d for d in range(2)]
        for p in positions.tolist()
    ]
    wrong = int((out != torch.tensor(expected, dtype=torch.int64)).sum())
    return {"offsets_wrong": float(wrong)}


CHECKS: dict[str, Callable[[], dict[str, float]]] = {"kv_offsets_past_2_31": check_kv_offsets_past_2_31}
TOLERANCE = {"offsets_wrong": 0.0}


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=120)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kv_offsets_are_64_bit(name: str, interpreted_results: dict[str, dict[str, object]]) -> None:
    assert_within(interpreted_results, name, TOLERANCE, 0.0)


if __name__ == "__main__":
    report(CHECKS)
