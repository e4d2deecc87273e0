"""One rank's step runner on the tiny model, in process on the CPU, and the commands it is fed."""

from __future__ import annotations

import torch

from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import DecodeRow, PrefillChunk
from phalanx.worker.commands import StepRunner

PAGE = 4
MAX_SLOTS = 3
KV_PAGES = 16


def new_runner(model: Qwen35Model) -> StepRunner:
    """A fresh rank state on a freshly allocated cache."""
    model.allocate_cache(KV_PAGES + 1, PAGE, 2 * MAX_SLOTS)
    return StepRunner(model, torch.device("cpu"), 0, PAGE, KV_PAGES, MAX_SLOTS, 64)


def prefill_chunk(
    request_id: int, tokens: list[int], start: int, pages: list[int], last: bool = True
) -> PrefillChunk:
    return PrefillChunk(request_id, pack_ids(tokens), start, pack_ids(pages), last)


def decode_row(request_id: int, slot: int, position: int, pages: list[int], token: int = 3) -> DecodeRow:
    return DecodeRow(request_id, slot, token, position, pack_ids(pages))


def prefilled_runner(model: Qwen35Model, prompts: list[list[int]]) -> tuple[StepRunner, list[int]]:
    """A fresh rank state with ``prompts`` prefilled (request i + 1 in pages 2i, 2i + 1)."""
    runner = new_runner(model)
    chunks = [prefill_chunk(i + 1, p, 0, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    results = runner.prefill(chunks).results
    return runner, [r.token for r in results]
