"""Rank 0 token sampling: greedy, temperature, top-k, top-p, min-p, logit bias, banned ids,
per-request seeds, top-N logprobs.

``draw_tokens(logits, params, positions)`` picks one token per row. ``positions[i]`` is the position
the sampled token will occupy (the prompt length for a request's first output token, ``p + 1``
for a decode row that feeds the token at ``p``). A seeded row draws its uniform number from a
hash of ``(seed, position)`` and nothing else, so a request's tokens never depend on what it is
batched with. The draw itself is an inverse-CDF lookup over the filtered distribution, with the
vocabulary sorted by probability (ties by ascending id), so it is exact and reproducible.

Reported logprobs are those of the model's raw distribution (``log_softmax`` of the logits,
before bias, bans, temperature and filters), as the OpenAI API does. Rank 0 holds the full
vocabulary's logits (the head gathers them), so bias and bans act on every id under any TP.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from phalanx.kernels.upload import to_device
from phalanx.protocol.messages import GREEDY_BELOW, SamplingParams

if TYPE_CHECKING:
    from phalanx.worker.graph_inputs import LandedTokens


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


def _upload(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without a stream sync (``kernels/upload.py``): a step with a
    sampled row must not wait for its own forward before the next step is launched."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _validate(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sampling expects logits of shape [rows, vocab], got {tuple(logits.shape)}")
    rows = logits.shape[0]
    if len(params) != rows or len(positions) != rows:
        raise ValueError(
            f"sampling got {rows} logit rows but {len(params)} parameter sets and {len(positions)} positions"
        )
    vocab = logits.shape[1]
    for index, p in enumerate(params):
        if p.temperature < 0 or p.top_k < 0 or not 0.0 < p.top_p <= 1.0 or not 0.0 <= p.min_p <= 1.0:
            raise ValueError(f"invalid sampling parameters for row {index}: {p}")
        for token in [*(p.logit_bias or ()), *(p.banned_ids or ())]:
            if not 0 <= token < vocab:
                raise ValueError(
                    f"sampling row {index} names token id {token} outside the vocabulary [0, {vocab})"
                )


def _steered(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int], allowed: torch.Tensor | None
) -> torch.Tensor | None:
    """The logits with each row's bias added, its banned ids and the ids its grammar does not
    allow (``allowed`` False) at -inf; None if no row has any of these. A ban that would leave a
    row nothing its grammar allows is lifted for that row: the output must follow the grammar."""
    steered = None
    if allowed is not None:
        steered = torch.where(allowed, logits.to(torch.float32), float("-inf"))
    for row, (p, position) in enumerate(zip(params, positions, strict=True)):
        banned = p.banned_ids if p.banned_ids and position < p.banned_until else None
        if not p.logit_bias and not banned:
            continue
        if steered is None:
            steered = logits.to(torch.float32, copy=True)
        if p.logit_bias:
            ids = _upload(list(p.logit_bias), torch.int64, logits.device)
            bias = _upload(list(p.logit_bias.values()), torch.float32, logits.device)
            steered[row].index_add_(0, ids, bias)
        if banned:
            unbanned = steered[row].clone() if allowed is not None else None
            # index_fill_ takes the value as a kernel argument; an indexed assignment copies it
            # to the GPU from pageable memory, a stream sync
            steered[row].index_fill_(0, _upload(list(banned), torch.int64, logits.device), float("-inf"))
            if unbanned is not None and not bool(torch.isfinite(steered[row]).any()):
                steered[row] = unbanned  # the grammar allows only banned ids: it wins over the ban
    return steered


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index, which is the smallest id among ties.
    return torch.argmax(logits, dim=-1)


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """Sample the rows of ``logits`` (all with temperature > 0); returns token ids [rows]."""
    device = logits.device
    # One upload for every row's parameters (top_k is exact in float64).
    columns = [
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
        [_row_uniform(p, pos) for p, pos in zip(params, positions, strict=True)],
    ]
    temperature, top_k, top_p, min_p, uniform = _upload(columns, torch.float64, device)
    top_k = top_k.to(torch.int64)

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
    keep &= probs >= min_p[:, None] * probs[:, :1]

    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(kept, dim=-1)
    target = uniform[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)
    # Rounding can put the target on the last kept boundary; clamp to the last kept token.
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    index = torch.minimum(index, last_kept)
    return torch.gather(sorted_ids, -1, index).squeeze(-1)


class _Report(NamedTuple):
    """The logprob report's tensors, still on the device: the chosen tokens' logprobs [rows] and
    the ``widest`` top ids and logprobs [rows, widest] (None when no row asked for them)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None


def _logprob_report(
    logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> _Report | None:
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if not wanted:
        return None
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = torch.gather(logprobs, -1, tokens[:, None]).squeeze(-1)
    widest = max(wanted)
    if widest == 0:
        return _Report(chosen, None, None)
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return _Report(chosen, ids[:, :widest], values[:, :widest])


class DrawnTokens:
    """One step's tokens, picked on the logits' device, on their way to the host.

    ``tokens`` stays on the device (a pipelined next step feeds from it); the copies to the host
    start at once and ``ready`` says whether they have landed, so a rank can answer a step without
    blocking on the GPU while another command might arrive (``worker/loop.py``). With ``landed``
    (the decode graph stored these very tokens in pinned memory itself) there is no copy to make.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        report: _Report | None,
        params: list[SamplingParams],
        landed: LandedTokens | None = None,
    ) -> None:
        self.tokens = tokens
        self._params = params
        on_device = tokens.device.type == "cuda"
        self._landed = landed
        # A non-blocking copy to the CPU lands in pinned memory, in stream order.
        self._host_tokens = None if landed is not None else tokens.to("cpu", non_blocking=on_device)
        self._host_report = None
        if report is not None:
            self._host_report = _Report(
                *(None if t is None else t.to("cpu", non_blocking=on_device) for t in report)
            )
        self._copied: torch.cuda.Event | None = None
        if on_device:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def ready(self) -> bool:
        return self._copied is None or self._copied.query()

    def token_ids(self) -> list[int]:
        """Each row's token (waits for the copies)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host_tokens.tolist() if self._landed is None else self._landed.read()

    def to_host(self) -> list[Sample]:
        """Each row's Sample (waits for the copies)."""
        tokens = self.token_ids()
        report = self._host_report
        if report is None:
            return [Sample(token, None, None, None) for token in tokens]
        chosen = report.chosen.tolist()
        rows = len(tokens)
        top_ids = report.top_ids.tolist() if report.top_ids is not None else [[]] * rows
        top_values = report.top_values.tolist() if report.top_values is not None else [[]] * rows
        samples = []
        for row, (token, p) in enumerate(zip(tokens, self._params, strict=True)):
            if p.logprobs is None:
                samples.append(Sample(token, None, None, None))
            else:
                n = p.logprobs
                samples.append(Sample(token, chosen[row], top_ids[row][:n], top_values[row][:n]))
        return samples


def draw_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    greedy: torch.Tensor | None = None,
    landed: LandedTokens | None = None,
    allowed: torch.Tensor | None = None,
) -> DrawnTokens:
    """Pick one token per row of ``logits`` [rows, vocab] (any float dtype, CPU or CUDA), on its
    device; ``to_host()`` of the result gives each row's Sample. ``greedy``, when given, is every
    row's argmax already (the decode graph picks it): rows that sample replace theirs in a copy.
    ``landed`` is where the graph also stored ``greedy`` on the host: read there if no row samples.
    ``allowed`` (bool [rows, vocab], on the logits' device) are the ids each row may pick (a grammar's mask)."""
    _validate(logits, params, positions)
    steered = _steered(logits, params, positions, allowed)
    if steered is not None:
        greedy = None  # the graph's argmax saw the logits before bias and bans
    picked_from = logits if steered is None else steered
    tokens = _greedy(picked_from) if greedy is None else greedy
    drawn = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if drawn:
        index = _upload(drawn, torch.int64, logits.device)
        tokens = tokens.clone()
        tokens[index] = _draw(
            picked_from.index_select(0, index), [params[i] for i in drawn], [positions[i] for i in drawn]
        )
    if drawn or greedy is None:
        landed = None  # the landing holds the graph's argmax, not these tokens
    return DrawnTokens(tokens, _logprob_report(logits, tokens, params), params, landed)
