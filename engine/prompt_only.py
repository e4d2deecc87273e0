"""A prompt-only request (``max_tokens`` 0, as OpenAI's ``echo`` that generates nothing): its prompt
is prefilled and, if asked, scored, and no token comes out.

The scheduler runs requests that generate at least one token, so the engine runs this one as a
one-token request and drops that token here, before any reader sees it. Such a request ends at its
prefill, retired like any request that reaches its ``max_tokens`` there (its rank state dropped, its
slot and pages freed), and its pages hold the prompt alone (a sampled token is never cached).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from phalanx.scheduler.events import Event, FinishEvent, TokenEvent
from phalanx.scheduler.requests import GenerationParams


def prompt_only(
    params: GenerationParams, emit: Callable[[Event], None]
) -> tuple[GenerationParams, Callable[[Event], None]]:
    """The parameters the ranks run (one token, no grammar or logprobs for a token nobody sees)
    and the events the reader gets (all but that token; it ends with "length" and 0 tokens)."""
    one_token = dataclasses.replace(params, max_tokens=1, logprobs=None, grammar=None)

    def without_the_token(event: Event) -> None:
        if isinstance(event, TokenEvent):
            return
        if isinstance(event, FinishEvent):  # an end-of-sequence or stop id drawn ends nothing here
            reason = "cancelled" if event.reason == "cancelled" else "length"
            event = FinishEvent(reason, event.prompt_tokens, completion_tokens=0)
        emit(event)

    return one_token, without_the_token
