"""Pipelined decode on one rank: steps launched with ``FED_TOKEN`` rows before the step ahead is
read produce exactly the tokens of steps fed explicitly, eagerly and from the graph runner (its
static buffers on CPU, CUDA graphs on the GPU), through a slot compaction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.executor.precapture import run_precapture_sweep
from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    FED_TOKEN,
    Capacity,
    DecodeRow,
    DropRequest,
    Expectation,
    PrefillChunk,
    SlotMove,
)
from phalanx.worker.buckets import state_slot_layout
from phalanx.worker.commands import StepRunner
from phalanx.worker.graphs import build_graph_runner
from tests.support.gpu_checks import DEVICES

PAGE_SIZE, PAGES_PER_REQUEST, MAX_SLOTS = 8, 8, 4
CAPACITY = Capacity(
    kv_pages=MAX_SLOTS * PAGES_PER_REQUEST, page_size=PAGE_SIZE, max_slots=MAX_SLOTS, max_batch_tokens=64
)
PROMPTS = [[5, 9, 2], [7, 1, 1, 8, 3], [4], [6, 6]]
STEPS, DROP_AT = 24, 12


def _rank(model_dir: Path, device: torch.device, graphs: bool) -> StepRunner:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Qwen35Model.load(model_dir, rank=0, world_size=1, device=device, dtype=dtype)
    layout = state_slot_layout(MAX_SLOTS, cuda_graph=graphs)
    model.allocate_cache(CAPACITY.kv_pages + 1, PAGE_SIZE, layout.total)
    rank = StepRunner(model, device, 0, PAGE_SIZE, CAPACITY.kv_pages, MAX_SLOTS, CAPACITY.max_batch_tokens)
    if graphs:
        rank.graphs = build_graph_runner(model, CAPACITY, device, rank=0, world_size=1)
        run_precapture_sweep(rank.graphs.run_phase, rank.graphs.buckets)
    return rank


def _pages(request: int) -> bytes:
    return pack_ids(list(range(request * PAGES_PER_REQUEST, (request + 1) * PAGES_PER_REQUEST)))


def _generate(rank: StepRunner, pipelined: bool) -> dict[int, list[int]]:
    """Greedy tokens of every request; request 1 (slot 1) retires at step DROP_AT and request 3
    moves into its slot. Pipelined: each step is launched before the one ahead is read, except
    the first after the drop, which feeds the tokens read before it."""
    chunks = [PrefillChunk(r, pack_ids(p), 0, _pages(r), True) for r, p in enumerate(PROMPTS)]
    tokens = {result.request_id: [result.token] for result in rank.prefill(chunks).results}
    slot_of = {r: r for r in range(len(PROMPTS))}
    ahead = None
    for step in range(STEPS):
        if step == DROP_AT:
            if ahead is not None:
                for result in ahead.results():
                    tokens[result.request_id].append(result.token)
                ahead = None
            rank.drop(DropRequest(1, Expectation.MUST_EXIST, SlotMove(3, 3, 1)))
            slot_of = {0: 0, 3: 1, 2: 2}
        fed = pipelined and ahead is not None
        rows = [
            DecodeRow(r, slot, FED_TOKEN if fed else tokens[r][-1], len(PROMPTS[r]) + step, _pages(r))
            for r, slot in slot_of.items()
        ]
        launched = rank.decode(rows)
        if ahead is not None:
            for result in ahead.results():
                tokens[result.request_id].append(result.token)
        ahead = launched
        if not pipelined:
            for result in ahead.results():
                tokens[result.request_id].append(result.token)
            ahead = None
    if ahead is not None:
        for result in ahead.results():
            tokens[result.request_id].append(result.token)
    return tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_pipelined_steps_give_the_tokens_of_steps_fed_explicitly(
    tiny_model_dir: Path, device: str, graphs: bool
) -> None:
    explicit = _generate(_rank(tiny_model_dir, torch.device(device), graphs), pipelined=False)
    pipelined = _generate(_rank(tiny_model_dir, torch.device(device), graphs), pipelined=True)
    assert pipelined == explicit
    assert [len(explicit[r]) for r in range(len(PROMPTS))] == [1 + STEPS, 1 + DROP_AT, 1 + STEPS, 1 + STEPS]
