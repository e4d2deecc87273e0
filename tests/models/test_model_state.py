"""Cache sizing, state slots and step inputs of Qwen35Model (TP 1 and per-rank layouts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.models.qwen35 import DecodeBatch, PrefillBatch, Qwen35Model
from tests.support.gpu_checks import DEVICES


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Qwen35Model:
    return Qwen35Model.load(tiny_model_dir)


def test_cache_sizes(tiny_model_dir: Path, model: Qwen35Model) -> None:
    # 2 full-attention layers x K and V x 16 positions x 2 KV heads x 32 dims x 4 bytes
    assert model.kv_bytes_per_page(16) == 2 * 2 * 16 * 2 * 32 * 4
    # 2 GDN layers x (8 value heads x 16 x 16 fp32 + conv_dim 256 x (K-1) 3 x 4 bytes)
    assert model.state_bytes_per_slot() == 2 * (8 * 16 * 16 * 4 + 256 * 3 * 4)
    bf16_rank = Qwen35Model.load(tiny_model_dir, rank=3, world_size=4, dtype=torch.bfloat16)
    # TP 4: one (replicated) KV head, 2 value heads, conv_dim 64; recurrent state stays fp32
    assert bf16_rank.kv_bytes_per_page(16) == 2 * 2 * 16 * 1 * 32 * 2
    assert bf16_rank.state_bytes_per_slot() == 2 * (2 * 16 * 16 * 4 + 64 * 3 * 2)
    bf16_state = Qwen35Model.load(tiny_model_dir, state_dtype=torch.bfloat16)
    assert bf16_state.state_bytes_per_slot() == 2 * (8 * 16 * 16 * 2 + 256 * 3 * 4)


def test_a_bf16_recurrent_state_keeps_greedy_tokens_and_logits_near_fp32(tiny_model_dir: Path) -> None:
    """The state is stored in bf16 and stepped in fp32: over a prompt and 24 decode steps the
    logits stay within bf16 rounding of the fp32 state's, and the greedy tokens are the same."""
    runs = {}
    for state_dtype in (torch.float32, torch.bfloat16):
        model = Qwen35Model.load(tiny_model_dir, state_dtype=state_dtype)
        model.allocate_cache(num_pages_total=16, page_size=8, num_state_slots=2)
        prompt = list(range(3, 40))
        logits = [model.prefill(PrefillBatch.build([(prompt, 0, 1, list(range(8)))]))[0]]
        tokens = [int(logits[-1].argmax())]
        for step in range(24):
            row = (tokens[-1], len(prompt) + step, 1, list(range(8)))
            logits.append(model.decode(DecodeBatch.build([row]))[0])
            tokens.append(int(logits[-1].argmax()))
        assert model.layers[0].linear_attention.recurrent_state.dtype == state_dtype
        runs[state_dtype] = tokens, torch.stack(logits)
    (fp32_tokens, fp32_logits), (bf16_tokens, bf16_logits) = runs[torch.float32], runs[torch.bfloat16]
    assert bf16_tokens == fp32_tokens
    relative = (bf16_logits - fp32_logits).norm() / fp32_logits.norm()
    assert 0 < relative < 1e-2


def test_steps_before_allocate_cache(tiny_model_dir: Path) -> None:
    fresh = Qwen35Model.load(tiny_model_dir)
    with pytest.raises(RuntimeError, match="rank 0: prefill before allocate_cache"):
        fresh.prefill(PrefillBatch.build([([1, 2], 0, 0, [0])]))
    with pytest.raises(RuntimeError, match="rank 0: decode before allocate_cache"):
        fresh.decode(DecodeBatch.build([(1, 0, 0, [0])]))


def test_copy_state_and_padded_page_tables(model: Qwen35Model) -> None:
    model.allocate_cache(num_pages_total=16, page_size=8, num_state_slots=4)
    prompt = list(range(3, 40))
    model.prefill(PrefillBatch.build([(prompt, 0, 0, [1, 2, 3, 4, 5])]))
    model.copy_state(0, 3)
    for gdn in (layer.linear_attention for layer in model.layers if layer.linear_attention):
        assert torch.equal(gdn.recurrent_state[3], gdn.recurrent_state[0])
        assert torch.equal(gdn.conv_state[3], gdn.conv_state[0])
        assert not gdn.recurrent_state[1].any() and not gdn.conv_state[1].any()  # only slot 3 written
    # Both slots continue identically; the second row's table is padded to 9 pages.
    rows = [(7, len(prompt), 0, [1, 2, 3, 4, 5]), (7, len(prompt), 3, [1, 2, 3, 4, 5])]
    logits = model.decode(DecodeBatch.build(rows, max_pages=9))
    assert torch.equal(logits[0], logits[1])
    with pytest.raises(IndexError, match="rank 0: state slot 4 outside"):
        model.copy_state(0, 4)


def test_batch_builders() -> None:
    batch = PrefillBatch.build([([5, 6, 7], 0, 2, [4]), ([8], 16, 1, [9, 3])])
    assert batch.tokens.tolist() == [5, 6, 7, 8]
    assert batch.cu_seqlens.tolist() == [0, 3, 4] and batch.cu_seqlens.dtype == torch.int32
    assert batch.starts.tolist() == [0, 16] and batch.state_slots.dtype == torch.int64
    assert batch.page_tables.tolist() == [[4, 4], [9, 3]]  # padded with a valid page
    decode = DecodeBatch.build([(1, 5, 0, [2]), (3, 20, 1, [6, 7])], max_pages=4)
    assert decode.page_table.tolist() == [[2, 2, 2, 2], [6, 7, 6, 6]]
    assert decode.positions.dtype == torch.int64 and decode.page_table.dtype == torch.int32
    with pytest.raises(ValueError, match="page table row 1 has 2 pages, more than max_pages=1"):
        DecodeBatch.build([(1, 5, 0, [2]), (3, 20, 1, [6, 7])], max_pages=1)
    with pytest.raises(ValueError, match="prefill chunk 0 has no tokens"):
        PrefillBatch.build([([], 0, 0, [1])])


def test_prefill_extent_checks(model: Qwen35Model) -> None:
    model.allocate_cache(num_pages_total=8, page_size=8, num_state_slots=2)
    with pytest.raises(
        ValueError, match="rank 0: prefill chunk 1 reaches position 16 but its page table has 2 pages of 8"
    ):
        model.prefill(PrefillBatch.build([([1] * 3, 0, 0, [1]), ([2] * 9, 8, 1, [2, 3])]))
    with pytest.raises(ValueError, match="reaches position 2049, beyond max_position_embeddings=2048"):
        model.prefill(PrefillBatch.build([([1, 2], 2048, 0, [0] * 257)]))
    with pytest.raises(
        ValueError, match=r"rank 0: prefill token id 512 is outside the vocabulary \[0, 512\)"
    ):
        model.prefill(PrefillBatch.build([([1, 512], 0, 0, [0])]))


@pytest.mark.parametrize("device", DEVICES)
def test_a_state_copied_away_and_back_resumes_the_prefill_exactly(tiny_model_dir: Path, device: str) -> None:
    """A prefix cache hit at the model's level: the state after 16 tokens is copied into a spare
    slot, its own slot is reused, and a third slot resumes from the copy over the prefix's KV
    pages. Its logits and state are bit for bit those of the same prompt prefilled in two chunks
    split at 16 (the same kernels on the same values), and on the CPU (fp32) those of one
    uninterrupted prefill within rounding."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen35Model.load(tiny_model_dir, device=device, dtype=dtype)
    model.allocate_cache(num_pages_total=16, page_size=8, num_state_slots=5)
    prompt = list(range(3, 40))

    def prefill(tokens: list[int], start: int, slot: int, pages: list[int]) -> torch.Tensor:
        return model.prefill(PrefillBatch.build([(tokens, start, slot, pages)], device), all_logits=True)

    whole = prefill(prompt, 0, 0, [1, 2, 3, 4, 5])
    split = torch.cat(
        [prefill(prompt[:16], 0, 4, [13, 14]), prefill(prompt[16:], 16, 4, [13, 14, 10, 11, 12])]
    )
    head = prefill(prompt[:16], 0, 1, [6, 7])
    model.copy_state(1, 3)  # the snapshot
    prefill(list(range(50, 60)), 0, 1, [8, 9])  # slot 1 reused
    model.copy_state(3, 2)  # the restore
    resumed = torch.cat([head, prefill(prompt[16:], 16, 2, [6, 7, 10, 11, 12])])
    assert torch.equal(resumed, split)
    for gdn in (layer.linear_attention for layer in model.layers if layer.linear_attention):
        assert torch.equal(gdn.recurrent_state[2], gdn.recurrent_state[4])
        assert torch.equal(gdn.conv_state[2], gdn.conv_state[4])
        if device == "cpu":
            torch.testing.assert_close(gdn.recurrent_state[2], gdn.recurrent_state[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(gdn.conv_state[2], gdn.conv_state[0], rtol=1e-4, atol=1e-5)
    if device == "cpu":
        torch.testing.assert_close(resumed, whole, rtol=1e-4, atol=1e-4)
