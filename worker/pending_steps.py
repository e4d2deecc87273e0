"""Rank 0's steps in flight: launched, their sampled tokens on their way to the host."""

from __future__ import annotations

from abc import ABC, abstractmethod

from phalanx.protocol.messages import DecodeDone, PromptLogprobs, RequestRejected, TokenResult, UnifiedDone
from phalanx.worker.sampling import DrawnTokens
from phalanx.worker.step_plans import RowPlan, rejections


class PendingStep(ABC):
    """Rank 0's step, launched, its tokens on their way to the host: the loop sends ``reply()``
    once ``ready()`` says it will not wait for the GPU (``worker/loop.py``)."""

    op: str  # the command, for a poison's reason

    @abstractmethod
    def ready(self) -> bool: ...

    @abstractmethod
    def reply(self) -> DecodeDone | UnifiedDone: ...


class PendingDecode(PendingStep):
    """A Decode's rows' tokens; a rejected row's token is drawn (a pipelined row may feed it) but
    not answered."""

    op = "decode"

    def __init__(self, plans: list[RowPlan], drawn: DrawnTokens) -> None:
        self._plans = plans
        self._drawn = drawn
        self.rejected = rejections(plans)

    def ready(self) -> bool:
        """Whether ``results`` can return without waiting for the GPU."""
        return self._drawn.ready()

    def results(self) -> list[TokenResult]:
        samples = self._drawn.to_host()
        return [
            TokenResult(plan.row.request_id, *drawn)
            for plan, drawn in zip(self._plans, samples, strict=True)
            if plan.rejected is None
        ]

    def reply(self) -> DecodeDone:
        return DecodeDone(self.results(), self.rejected)


class PendingPrefill:
    """The tokens sampled at a prefill's last chunks (none when no chunk was a prompt's last),
    and the prompt logprobs of the chunks that asked for them; the rejected requests' are left out."""

    def __init__(
        self,
        request_ids: list[int],
        drawn: DrawnTokens | None,
        prompt_logprobs: list[PromptLogprobs],
        rejected: list[RequestRejected],
    ) -> None:
        self._request_ids = request_ids
        self._drawn = drawn
        self.rejected = rejected
        self._left_out = {entry.request_id for entry in rejected}
        self.prompt_logprobs = [span for span in prompt_logprobs if span.request_id not in self._left_out]

    def ready(self) -> bool:
        return self._drawn is None or self._drawn.ready()

    def results(self) -> list[TokenResult]:
        if self._drawn is None:
            return []
        samples = self._drawn.to_host()
        return [
            TokenResult(rid, *sample)
            for rid, sample in zip(self._request_ids, samples, strict=True)
            if rid not in self._left_out
        ]


class PendingUnified(PendingStep):
    """A Unified's prefill half's tokens and its decode half's."""

    op = "unified"

    def __init__(self, prefill: PendingPrefill, decode: PendingDecode) -> None:
        self._prefill = prefill
        self._decode = decode

    def ready(self) -> bool:
        return self._prefill.ready() and self._decode.ready()

    def reply(self) -> UnifiedDone:
        return UnifiedDone(
            self._prefill.results(),
            self._decode.results(),
            self._prefill.prompt_logprobs,
            self._prefill.rejected + self._decode.rejected,
        )
