"""Rank 0's steps in flight: launched, their sampled tokens on their way to the host."""

from __future__ import annotations

from abc import ABC, abstractmethod

from phalanx.protocol.messages import DecodeDone, PromptLogprobs, TokenResult, UnifiedDone
from phalanx.worker.sampling import DrawnTokens
from phalanx.worker.step_plans import RowPlan


class PendingStep(ABC):
    """Rank 0's step, launched, its tokens on their way to the host: the loop sends ``reply()``
    once ``ready()`` says it will not wait for the GPU (``worker/loop.py``)."""

    op: str  # the command, for a poison's reason

    @abstractmethod
    def ready(self) -> bool: ...

    @abstractmethod
    def reply(self) -> DecodeDone | UnifiedDone: ...


class PendingDecode(PendingStep):
    """A Decode's rows' tokens."""

    op = "decode"

    def __init__(self, plans: list[RowPlan], drawn: DrawnTokens) -> None:
        self._plans = plans
        self._drawn = drawn

    def ready(self) -> bool:
        """Whether ``results`` can return without waiting for the GPU."""
        return self._drawn.ready()

    def results(self) -> list[TokenResult]:
        samples = self._drawn.to_host()
        return [
            TokenResult(plan.row.request_id, *drawn) for plan, drawn in zip(self._plans, samples, strict=True)
        ]

    def reply(self) -> DecodeDone:
        return DecodeDone(self.results())


class PendingPrefill:
    """The tokens sampled at a prefill's last chunks (none when no chunk was a prompt's last),
    and the prompt logprobs of the chunks that asked for them."""

    def __init__(
        self, request_ids: list[int], drawn: DrawnTokens | None, prompt_logprobs: list[PromptLogprobs]
    ) -> None:
        self._request_ids = request_ids
        self._drawn = drawn
        self.prompt_logprobs = prompt_logprobs

    def ready(self) -> bool:
        return self._drawn is None or self._drawn.ready()

    def results(self) -> list[TokenResult]:
        if self._drawn is None:
            return []
        samples = self._drawn.to_host()
        return [TokenResult(rid, *sample) for rid, sample in zip(self._request_ids, samples, strict=True)]


class PendingUnified(PendingStep):
    """A Unified's prefill half's tokens and its decode half's."""

    op = "unified"

    def __init__(self, prefill: PendingPrefill, decode: PendingDecode) -> None:
        self._prefill = prefill
        self._decode = decode

    def ready(self) -> bool:
        return self._prefill.ready() and self._decode.ready()

    def reply(self) -> UnifiedDone:
        return UnifiedDone(self._prefill.results(), self._decode.results(), self._prefill.prompt_logprobs)
