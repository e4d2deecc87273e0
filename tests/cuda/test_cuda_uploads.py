"""A step's inputs and its sampling never wait for the GPU: prefill and decode batches, sampled
rows, logit bias and banned ids upload from pinned memory (``kernels/upload.py``), so a rank
launches a step while the one before it still runs (a copy from pageable memory synchronises the
stream, which ``set_sync_debug_mode("error")`` turns into an error)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from phalanx.models.qwen35 import DecodeBatch, PrefillBatch  # noqa: E402
from phalanx.protocol.messages import SamplingParams  # noqa: E402
from phalanx.worker.sampling import draw_tokens  # noqa: E402


def test_prefill_and_decode_batches_upload_without_a_stream_sync() -> None:
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    busy @ busy  # queued work a synchronising copy would wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        prefill = PrefillBatch.build(
            [(list(range(200)), 0, 1, list(range(13))), (list(range(70)), 64, 2, list(range(5)))],
            "cuda",
            [(0, 128, 3)],
        )
        decode = DecodeBatch.build([(5, 10, 0, [1]), (6, 20, 1, [2, 3])], "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert prefill.tokens.is_cuda and prefill.varlen.cu_seqlens.tolist() == [0, 200, 270]
    assert decode.positions.tolist() == [10, 20] and decode.page_table.tolist() == [[1, 1], [2, 3]]


def test_sampled_rows_with_bias_and_bans_draw_without_a_stream_sync() -> None:
    logits = torch.randn(4, 1000, device="cuda")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.05, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.0, banned_ids=[int(logits[3].argmax())], banned_until=10),
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = draw_tokens(logits, params, [5, 5, 5, 5])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens = drawn.tokens.tolist()
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[2] == 7  # a +100 bias wins the draw
    assert tokens[3] != int(logits[3].argmax())
