"""The single-chunk prefill a graph replays (``worker/prefill_graphs.py``), run eagerly on CPU:
the chunk's logits, its recurrent and conv state, a mid-chunk capture and its K/V equal a plain
pass's, fresh and continuing a cached prefix, with a padding chunk beside it or filling its
bucket alone; the padding touches only its own slot and the padding page."""

from __future__ import annotations

import pytest
import torch

from phalanx.models.qwen35 import PrefillBatch, Qwen35Model
from phalanx.worker.prefill_graphs import GraphKey, PrefillGraphRunner

PAGE = 16
KV_PAGES = 64  # page 64 is the padding page
SLOTS = 8
PAD_SLOT = 7
MAX_PAGES = 20


@pytest.fixture
def graphs(model: Qwen35Model) -> PrefillGraphRunner:
    model.allocate_cache(KV_PAGES + 1, PAGE, SLOTS)
    return PrefillGraphRunner(
        model, torch.device("cpu"), pad_slot=PAD_SLOT, pad_page=KV_PAGES, max_pages=MAX_PAGES
    )


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _states(model: Qwen35Model, slot: int) -> list[torch.Tensor]:
    layers = [layer.linear_attention for layer in model.layers if layer.linear_attention]
    return [g.recurrent_state[slot].clone() for g in layers] + [g.conv_state[slot].clone() for g in layers]


def _kv(model: Qwen35Model, pages: list[int]) -> list[torch.Tensor]:
    layers = [layer.attention for layer in model.layers if layer.attention]
    return [cache[pages].clone() for a in layers for cache in (a.k_cache, a.v_cache)]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("length", "start"), [(50, 0), (64, 0), (128, 64), (37, 80), (192, 0)])
def test_a_graph_s_pass_gives_the_plain_pass_s_logits_states_and_kv(
    model: Qwen35Model, graphs: PrefillGraphRunner, length: int, start: int
) -> None:
    head, tokens = _prompt(start, 1), _prompt(length, 2)
    ours, theirs = list(range(0, 12)), list(range(20, 32))
    if start:  # both slots continue the same cached prefix
        model.prefill(PrefillBatch.build([(head, 0, 1, ours)]))
        model.prefill(PrefillBatch.build([(head, 0, 2, theirs)]))
    key = graphs.key_for(length, start, len(ours), 0)
    bucket = next(t for t in (64, 128, 256) if length <= t)
    assert key == GraphKey(bucket, length % 64 == 0, 0, padded=length < bucket)
    logits = graphs.prefill(key, tokens, start, 1, ours, [])
    plain = model.prefill(PrefillBatch.build([(tokens, start, 2, theirs)]))
    torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-5)
    _close(_states(model, 1), _states(model, 2))
    used = -(-(start + length) // PAGE)
    _close(_kv(model, ours[:used]), _kv(model, theirs[:used]))


def test_a_capture_inside_the_chunk_equals_the_plain_pass_s(
    model: Qwen35Model, graphs: PrefillGraphRunner
) -> None:
    tokens = _prompt(150, 3)
    key = graphs.key_for(150, 0, 12, 1)
    assert key == GraphKey(256, False, 1)
    graphs.prefill(key, tokens, 0, 1, list(range(12)), [(128, 4)])
    model.prefill(PrefillBatch.build([(tokens, 0, 2, list(range(20, 32)))], "cpu", [(0, 128, 5)]))
    _close(_states(model, 4), _states(model, 5))
    _close(_states(model, 1), _states(model, 2))


def test_what_no_graph_holds_runs_eagerly(graphs: PrefillGraphRunner) -> None:
    assert graphs.buckets == (64, 128, 256)  # 512 tokens pass 20 pages of 16
    assert graphs.key_for(257, 0, 17, 0) is None  # longer than the largest bucket
    assert graphs.key_for(100, 0, 7, 2) is None  # two captures
    assert graphs.key_for(64, 0, 4, 1) is None  # no capture fits a chunk of one 64-token block
    assert graphs.key_for(100, 0, MAX_PAGES + 1, 0) is None  # wider than the page table


def test_a_token_outside_the_vocabulary_is_refused(model: Qwen35Model, graphs: PrefillGraphRunner) -> None:
    key = graphs.key_for(3, 0, 1, 0)
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=f"^rank 0: prefill token id {vocab} is outside the vocabulary"):
        graphs.prefill(key, [1, vocab, 2], 0, 1, [0], [])


def test_the_host_facts_a_graph_bakes_in_are_its_key_s_alone(graphs: PrefillGraphRunner) -> None:
    """A graph replays what its capture saw on the host; every chunk a key serves must stage the
    same host facts (counts, longest, whether states are gathered) whatever its start and length."""
    served = {
        GraphKey(128, False, 0): [(65, 0, []), (100, 64, []), (127, 180, [])],
        GraphKey(128, True, 1, padded=False): [(128, 0, [(64, 4)]), (128, 16, [(64, 5)])],
        GraphKey(256, True, 0): [(192, 0, []), (192, 64, [])],
        GraphKey(64, False, 0): [(1, 0, []), (37, 80, [])],
    }
    for key, chunks in served.items():
        facts = set()
        for length, start, captures in chunks:
            pages = list(range(-(-(start + length) // PAGE)))
            assert graphs.key_for(length, start, len(pages), len(captures)) == key
            layout = graphs._stage(key, _prompt(length, 3), start, 1, pages, captures)
            facts.add((layout.counts, layout.longest, layout.continues, layout.continues_all))
        assert len(facts) == 1, (key, facts)
        assert next(iter(facts))[1:] == (key.tokens, True, False), key
