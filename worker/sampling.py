"""Rank 0 token sampling: greedy, temperature, top-k, top-p, per-request seeds, top-N logprobs.

``sample(logits, params, positions)`` picks one token per row. ``positions[i]`` is the position
the sampled token will occupy (the prompt length for a request's first output token, ``p + 1``
for a decode row that feeds the token at ``p``). A seeded row draws its uniform number from a
hash of ``(seed, position)`` and nothing else, so a request's tokens never depend on what it is
batched with. The draw itself is an inverse-CDF lookup over the filtered distribution, with the
vocabulary sorted by probability (ties by ascending id), so it is exact and reproducible.

Reported logprobs are those of the model's raw distribution (``log_softmax`` of the logits,
before temperature and filters), as the OpenAI API does.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import NamedTuple

import torch

from protocol.messages import SamplingParams


class Sample(NamedTuple):
    """One row's outcome; unpacks as ``(token, logprob, top_ids, top_logprobs)``."""

    token: int
    logprob: float | None
    top_ids: list[int] | None
    top_logprobs: list[float] | None


_UNSEEDED = random.Random()


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, position), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))


def _row_uniform(params: SamplingParams, position: int) -> float:
    if params.seed is None:
        return _UNSEEDED.random()
    return seeded_uniform(params.seed, position)


def _validate(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sampling expects logits of shape [rows, vocab], got {tuple(logits.shape)}")
    rows = logits.shape[0]
    if len(params) != rows or len(positions) != rows:
        raise ValueError(
            f"sampling got {rows} logit rows but {len(params)} parameter sets and {len(positions)} positions"
        )
    for index, p in enumerate(params):
        if p.temperature < 0 or p.top_k < 0 or not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"invalid sampling parameters for row {index}: {p}")


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index, which is the smallest id among ties.
    return torch.argmax(logits, dim=-1)


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """Sample the rows of ``logits`` (all with temperature > 0); returns token ids [rows]."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    uniform = torch.tensor(
        [_row_uniform(p, pos) for p, pos in zip(params, positions, strict=True)],
        dtype=torch.float64,
        device=device,
    )

    scaled = logits.to(torch.float64) / temperature[:, None]
    # Stable descending sort keeps equal probabilities in ascending id order.
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)

    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=device)[None, :]
    effective_k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    keep = rank < effective_k[:, None]
    # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass strictly
    # before it is still below top_p. The first token always stays.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (rank == 0)

    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(kept, dim=-1)
    target = uniform[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)
    # Rounding can put the target on the last kept boundary; clamp to the last kept token.
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    index = torch.minimum(index, last_kept)
    return torch.gather(sorted_ids, -1, index).squeeze(-1)


def _logprob_report(
    logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> list[tuple[float | None, list[int] | None, list[float] | None]]:
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return [(None, None, None)] * len(params)
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = torch.gather(logprobs, -1, tokens[:, None]).squeeze(-1).tolist()
    widest = max(n for n in wanted if n is not None)
    top_values: list[list[float]] = [[] for _ in params]
    top_ids: list[list[int]] = [[] for _ in params]
    if widest > 0:
        values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        top_values = values[:, :widest].tolist()
        top_ids = ids[:, :widest].tolist()
    report: list[tuple[float | None, list[int] | None, list[float] | None]] = []
    for row, n in enumerate(wanted):
        if n is None:
            report.append((None, None, None))
        else:
            report.append((chosen[row], top_ids[row][:n], top_values[row][:n]))
    return report


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[Sample]:
    """Pick one token per row of ``logits`` [rows, vocab] (any float dtype, CPU or CUDA)."""
    _validate(logits, params, positions)
    if logits.shape[0] == 0:
        return []
    tokens = _greedy(logits)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        tokens = tokens.clone()
        tokens[index] = _draw(
            logits.index_select(0, index), [params[i] for i in drawn], [positions[i] for i in drawn]
        )
    report = _logprob_report(logits, tokens, params)
    return [
        Sample(token, logprob, top_ids, top_logprobs)
        for token, (logprob, top_ids, top_logprobs) in zip(tokens.tolist(), report, strict=True)
    ]
