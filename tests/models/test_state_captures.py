"""A prefill leaves linear-attention states behind mid-chunk (prefix-cache snapshots in one pass):
each captured state equals the final state of a prefill that stops there, and resumes the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.kernels.varlen import Varlen
from phalanx.models.qwen35 import PrefillBatch, Qwen35Model
from tests.support.gpu_checks import DEVICES

PAGE = 16


def _states(model: Qwen35Model, slot: int) -> list[torch.Tensor]:
    layers = [layer.linear_attention for layer in model.layers if layer.linear_attention]
    return [gdn.recurrent_state[slot].float() for gdn in layers] + [
        gdn.conv_state[slot].float() for gdn in layers
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_captured_states_equal_prefills_that_stop_there_and_resume_the_prompt(
    tiny_model_dir: Path, device: str
) -> None:
    model = Qwen35Model.load(tiny_model_dir, device=device, dtype=torch.float32)
    model.allocate_cache(num_pages_total=64, page_size=PAGE, num_state_slots=10)
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(0, 500, (200,), generator=generator).tolist()
    second = torch.randint(0, 500, (150,), generator=generator).tolist()
    pages_a, pages_b = list(range(0, 13)), list(range(13, 23))
    # One pass, two chunks: slot 0 takes `first`, slot 1 `second`; three captures on the way.
    captures = [(0, 64, 4), (0, 128, 5), (1, 128, 6)]
    batch = PrefillBatch.build([(first, 0, 0, pages_a), (second, 0, 1, pages_b)], device, captures)
    whole = model.prefill(batch, all_logits=True)

    for tokens, offset, captured, scratch in ((first, 64, 4, 7), (first, 128, 5, 8), (second, 128, 6, 9)):
        model.prefill(PrefillBatch.build([(tokens[:offset], 0, scratch, list(range(40, 50)))], device))
        for got, want in zip(_states(model, captured), _states(model, scratch), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)

    # The snapshot after 128 tokens resumes `first` over its own KV pages: the rest's logits are
    # the uninterrupted pass's.
    model.copy_state(5, 2)
    resumed = model.prefill(PrefillBatch.build([(first[128:], 128, 2, pages_a)], device), all_logits=True)
    torch.testing.assert_close(resumed, whole[128:200], rtol=1e-4, atol=1e-4)


def test_a_capture_off_the_delta_rules_chunk_grid_is_refused() -> None:
    for captures in ([(0, 96, 3)], [(0, 0, 3)], [(0, 128, 3)], [(1, 64, 3)]):
        with pytest.raises(ValueError, match="must fall inside the chunk at a multiple of 64 tokens"):
            Varlen.build([128], [0], torch.device("cpu"), captures)
