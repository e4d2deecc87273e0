"""Sampling on the GPU never waits for it: sampled rows, logit bias and banned ids upload their
parameters from pinned memory, so rank 0 can launch the next step while this one runs (a copy
from pageable memory would synchronise the stream, and ``set_sync_debug_mode("error")`` raises)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from phalanx.protocol.messages import SamplingParams  # noqa: E402
from phalanx.worker.sampling import draw_tokens  # noqa: E402


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
