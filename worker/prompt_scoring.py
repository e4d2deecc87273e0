"""Which tokens of a prefill batch score which prompt token, for chunks that ask for prompt logprobs.

The logits at a chunk's token ``i`` predict its token ``i + 1``; the chunk's last position predicts
``next_token`` (the first token of the prompt's next chunk), so a chunked prompt is scored whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phalanx.kernels.upload import to_device
from phalanx.models.qwen35.parallel import TokenScores
from phalanx.protocol.messages import NO_TOKEN, PrefillChunk, PromptLogprobs
from phalanx.worker.errors import WorkerStateError

MAX_PROMPT_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class _Span:
    request_id: int
    start: int  # position of the first scored token
    count: int
    top_n: int


@dataclass
class PromptScoring:
    rows: list[int] = field(default_factory=list)  # batch token whose logits score ...
    targets: list[int] = field(default_factory=list)  # ... this token
    spans: list[_Span] = field(default_factory=list)

    @property
    def top_n(self) -> int:
        return max(span.top_n for span in self.spans)

    @classmethod
    def plan(cls, chunks: list[tuple[PrefillChunk, list[int]]]) -> PromptScoring | None:
        """The scoring of ``chunks`` (each with its tokens, in batch order; their token ids are
        judged already, ``worker/step_plans.py``); None if none asks."""
        scoring = cls()
        offset = 0
        for chunk, tokens in chunks:
            if chunk.prompt_logprobs is not None:
                _check(chunk, chunk.prompt_logprobs)
                targets = tokens[1:] + ([] if chunk.next_token == NO_TOKEN else [chunk.next_token])
                scoring.rows += range(offset, offset + len(targets))
                scoring.targets += targets
                scoring.spans.append(
                    _Span(chunk.request_id, chunk.start + 1, len(targets), chunk.prompt_logprobs)
                )
            offset += len(tokens)
        return scoring if scoring.spans else None

    def results(self, scores: TokenScores | None) -> list[PromptLogprobs]:
        """Each span's PromptLogprobs (``scores`` None: no span scored any token)."""
        chosen: list[float] = [] if scores is None else scores.chosen.tolist()
        ranks: list[int] = [] if scores is None else scores.ranks.tolist()
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        if scores is not None and scores.top_ids is not None and scores.top_values is not None:
            top_ids, top_values = scores.top_ids.tolist(), scores.top_values.tolist()
        out, at = [], 0
        for span in self.spans:
            end, n = at + span.count, span.top_n
            out.append(
                PromptLogprobs(
                    span.request_id,
                    span.start,
                    chosen[at:end],
                    ranks[at:end],
                    [ids[:n] for ids in top_ids[at:end]] if n else None,
                    [values[:n] for values in top_values[at:end]] if n else None,
                )
            )
            at = end
        return out

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(torch.tensor(self.rows), device), to_device(torch.tensor(self.targets), device)


def _check(chunk: PrefillChunk, top_n: int) -> None:
    where = f"prefill chunk for request {chunk.request_id}"
    if not 0 <= top_n <= MAX_PROMPT_TOP_LOGPROBS:
        raise WorkerStateError(
            f"{where} asks for {top_n} prompt top logprobs (at most {MAX_PROMPT_TOP_LOGPROBS})"
        )
    if chunk.last != (chunk.next_token == NO_TOKEN):
        raise WorkerStateError(f"{where}: next_token {chunk.next_token} does not match last={chunk.last}")
