"""Rank 0 sampling: greedy ties, filters, seeded draws that ignore the batch, distribution, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from msgspec.structs import replace

from phalanx.protocol.messages import SamplingParams
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.graph_inputs import LandedTokens
from phalanx.worker.sampling import Sample, draw_tokens, seeded_uniform

GREEDY = SamplingParams()


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[Sample]:
    return draw_tokens(logits, params, positions).to_host()


def tokens(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None
) -> list[int]:
    return [s.token for s in sample(logits, params, positions or list(range(len(params))))]


def test_greedy_takes_the_maximum_and_ties_go_to_the_smallest_id() -> None:
    logits = torch.tensor(
        [[0.0, 2.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0, 7.0], [-1.0, -3.0, -1.0, -2.0, -9.0]]
    )
    assert tokens(logits, [GREEDY] * 3) == [2, 0, 0]


def test_seeded_draw_does_not_depend_on_the_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 300, generator=generator)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i) for i in range(9)]
    together = tokens(logits, params, list(range(20, 29)))
    alone = [tokens(logits[i : i + 1], [params[i]], [20 + i])[0] for i in range(9)]
    reordered = tokens(logits.flip(0), params[::-1], list(range(28, 19, -1)))[::-1]
    mixed_with_greedy = tokens(torch.cat([logits[:1], logits]), [GREEDY, *params], [0, *range(20, 29)])[1:]
    assert together == alone == reordered == mixed_with_greedy


def test_seeded_draws_vary_with_position_and_seed() -> None:
    assert seeded_uniform(1, 5) == seeded_uniform(1, 5)
    draws = {seeded_uniform(seed, position) for seed in range(20) for position in range(20)}
    assert len(draws) == 400 and all(0.0 <= u < 1.0 for u in draws)
    logits = torch.zeros(1, 1000)
    picks = {tokens(logits, [SamplingParams(temperature=1.0, seed=3)], [p])[0] for p in range(50)}
    assert len(picks) > 40


def test_sampling_follows_the_softmax_of_the_scaled_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    temperature = 0.7
    draws = 4000
    params = [SamplingParams(temperature=temperature, seed=seed) for seed in range(draws)]
    counts = Counter(tokens(logits.expand(draws, -1), params, [0] * draws))
    expected = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    for token, probability in enumerate(expected):
        sigma = math.sqrt(draws * probability * (1 - probability))
        assert abs(counts[token] - draws * probability) < 5 * sigma


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, 2.7]])
    seen_k = {tokens(logits, [SamplingParams(temperature=5.0, top_k=2, seed=s)], [0])[0] for s in range(300)}
    assert seen_k == {0, 1}
    # Probabilities ~ [0.29, 0.26, 0.24, 0.01, 0.00, 0.21]: top_p 0.5 needs the first two.
    seen_p = {
        tokens(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=s)], [0])[0] for s in range(300)
    }
    assert seen_p == {0, 1}
    one = [
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=1),
    ]
    assert tokens(torch.cat([logits, logits]), one) == [0, 0]


def test_logprobs_are_those_of_the_raw_distribution() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=2.0, seed=4, logprobs=0)]
    first, second = sample(logits, params, [0, 0])
    reference = torch.log_softmax(logits, dim=-1)
    assert first.token == 1 and first.logprob == pytest.approx(reference[0, 1].item())
    assert first.top_ids == [1, 2, 0]
    assert first.top_logprobs == pytest.approx(reference[0, [1, 2, 0]].tolist())
    assert second.logprob == pytest.approx(reference[1, second.token].item())
    assert second.top_ids == [] and second.top_logprobs == []
    plain = sample(logits, [GREEDY, GREEDY], [0, 0])
    assert [(s.logprob, s.top_ids, s.top_logprobs) for s in plain] == [(None, None, None)] * 2


def test_min_p_keeps_tokens_near_the_most_likely_one() -> None:
    # probabilities ~ [0.46, 0.31, 0.17, 0.06]: min_p 0.5 keeps those at least 0.23
    logits = torch.tensor([[2.0, 1.6, 1.0, 0.0]])
    seen = {tokens(logits, [SamplingParams(temperature=1.0, min_p=0.5, seed=s)], [0])[0] for s in range(400)}
    assert seen == {0, 1}
    assert len({tokens(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0] for s in range(400)}) == 4


def test_logit_bias_steers_greedy_and_drawn_rows_but_not_the_reported_logprobs() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    biased = SamplingParams(logit_bias={2: 100.0}, logprobs=1)
    (pick,) = sample(logits, [biased], [0])
    assert pick.token == 2
    assert pick.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())
    assert pick.top_ids == [1]
    banned_most_likely = SamplingParams(temperature=1.0, seed=3, logit_bias={1: -100.0})
    assert {tokens(logits, [replace(banned_most_likely, seed=s)], [0])[0] for s in range(200)} <= {0, 2, 3}
    # a graph's argmax (token 1) is not taken for a row whose bias changes the pick
    drawn = draw_tokens(logits, [biased], [0], greedy=torch.tensor([1]))
    assert drawn.to_host()[0].token == 2


def test_banned_ids_are_out_only_below_their_position() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    params = SamplingParams(banned_ids=[1], banned_until=5)
    assert tokens(logits.expand(3, -1), [params] * 3, [3, 4, 5]) == [2, 2, 1]
    seeded = SamplingParams(temperature=1.0, seed=1, banned_ids=[1, 2], banned_until=1)
    assert tokens(logits, [seeded], [0]) == [0]


def test_a_ban_yields_to_a_grammar_that_allows_only_banned_ids() -> None:
    logits = torch.tensor([[3.0, 0.0, 1.0, 2.0]])
    allowed = torch.tensor([[False, False, True, False]])
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=3)):
        banned = replace(params, banned_ids=[2], banned_until=5)
        assert [s.token for s in draw_tokens(logits, [banned], [0], allowed=allowed).to_host()] == [2]
    both = torch.tensor([[False, True, True, False]])
    kept = SamplingParams(banned_ids=[2], banned_until=5)
    assert [s.token for s in draw_tokens(logits, [kept], [0], allowed=both).to_host()] == [1]


def test_bad_shapes_and_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match=r"sampling got 2 logit rows but 1 parameter sets and 2 positions"):
        sample(torch.zeros(2, 4), [GREEDY], [0, 1])
    with pytest.raises(ValueError, match=r"expects logits of shape \[rows, vocab\]"):
        sample(torch.zeros(4), [GREEDY], [0])
    with pytest.raises(ValueError, match="invalid sampling parameters for row 0"):
        sample(torch.zeros(1, 4), [SamplingParams(top_p=0.0)], [0])
    with pytest.raises(ValueError, match="invalid sampling parameters for row 0"):
        sample(torch.zeros(1, 4), [SamplingParams(min_p=1.5)], [0])
    with pytest.raises(ValueError, match=r"sampling row 0 names token id 4 outside the vocabulary \[0, 4\)"):
        sample(torch.zeros(1, 4), [SamplingParams(logit_bias={4: 1.0})], [0])
    assert sample(torch.zeros(0, 4), [], []) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, logprobs=2) for i in range(8)]
    params += [SamplingParams(logprobs=1)] * 8
    on_cpu = sample(logits, params, list(range(16)))
    on_cuda = sample(logits.cuda(), params, list(range(16)))
    assert [s.token for s in on_cuda] == [s.token for s in on_cpu]
    assert [s.top_ids for s in on_cuda] == [s.top_ids for s in on_cpu]


def test_greedy_rows_read_the_tokens_a_graph_landed_and_sampled_rows_their_own() -> None:
    """With ``landed`` (a decode graph stored the greedy tokens in pinned memory) an all-greedy step
    reads them there; a step where any row samples reads its own tokens, and so does one whose
    greedy tokens were not the graph's."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    greedy = torch.tensor([1, 0])
    landing = torch.tensor([[-1, -1, -1], [5, 1, 0]])  # step 5's half: [seq, tokens...]
    landed = LandedTokens(landing, seq=5, rows=2)
    plain = SamplingParams()
    assert [s.token for s in draw_tokens(logits, [plain, plain], [4, 4], greedy, landed).to_host()] == [1, 0]
    landing[1, 1] = 2  # what the landing holds is what an all-greedy step reports
    assert [s.token for s in draw_tokens(logits, [plain, plain], [4, 4], greedy, landed).to_host()] == [2, 0]
    sampled = SamplingParams(temperature=1.0, top_k=1, seed=3)
    assert [s.token for s in draw_tokens(logits, [plain, sampled], [4, 4], greedy, landed).to_host()] == [
        1,
        0,
    ]
    assert [s.token for s in draw_tokens(logits, [plain, plain], [4, 4], None, landed).to_host()] == [1, 0]


def test_landed_tokens_overwritten_by_a_later_step_are_refused() -> None:
    landing = torch.tensor([[-1, -1, -1], [7, 1, 0]])  # step 7 wrote the half step 5 landed in
    with pytest.raises(
        WorkerStateError,
        match="greedy tokens of decode step 5 were overwritten by step 7 before rank 0 read them",
    ):
        LandedTokens(landing, seq=5, rows=2).read()


def test_a_temperature_below_greedy_below_picks_the_maximum() -> None:
    from phalanx.protocol.messages import GREEDY_BELOW

    logits = torch.tensor([[0.0, 3.0, -1.0, 2.9], [1.0, -5.0, 4.0, 0.0]])
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-308, GREEDY_BELOW / 2)]
    assert [s.token for s in sample(logits, params, [4, 4])] == [1, 2]
