"""One rank's step runner with prefix-cache snapshot slots on the tiny model (CPU, fp32), the
chunks that restore and save, and an uninterrupted prefill's outcome to compare a resumed one with."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from phalanx.executor.precapture import run_precapture_sweep
from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    MAX_LOGPROBS,
    Capacity,
    DecodeRow,
    PrefillChunk,
    SamplingParams,
    StateSnapshot,
    TokenResult,
)
from phalanx.worker.buckets import state_slot_layout
from phalanx.worker.commands import StepRunner
from phalanx.worker.graphs import build_graph_runner
from phalanx.worker.snapshots import SnapshotTable

PAGE = 4
MAX_SLOTS = 3
KV_PAGES = 160
MAX_BATCH_TOKENS = 512
SNAPSHOTS = 4
DECODE_STEPS = 3
SAMPLING = SamplingParams(logprobs=MAX_LOGPROBS)
CPU = torch.device("cpu")


def snapshot_runner(model: Qwen35Model, snapshots: int = SNAPSHOTS, graphs: bool = False) -> StepRunner:
    """A fresh rank state on a freshly allocated cache; ``graphs``: decode from the graph runner
    (its static buffers on CPU), whose padding rows take the spare slots before the snapshots."""
    layout = state_slot_layout(MAX_SLOTS, cuda_graph=graphs, snapshot_slots=snapshots)
    model.allocate_cache(KV_PAGES + 1, PAGE, layout.total)
    table = SnapshotTable(layout.snapshot_base, snapshots)
    runner = StepRunner(model, CPU, 0, PAGE, KV_PAGES, MAX_SLOTS, MAX_BATCH_TOKENS, table)
    if graphs:
        capacity = Capacity(KV_PAGES, PAGE, MAX_SLOTS, MAX_BATCH_TOKENS, snapshots)
        runner.graphs = build_graph_runner(model, capacity, CPU, rank=0, world_size=1)
        run_precapture_sweep(runner.graphs.run_phase, runner.graphs.buckets)
    return runner


def chunk(
    request_id: int,
    tokens: list[int],
    start: int,
    pages: list[int],
    last: bool = True,
    restore: StateSnapshot | None = None,
    save: tuple[StateSnapshot, ...] = (),
    prompt_logprobs: int | None = None,
) -> PrefillChunk:
    return PrefillChunk(
        request_id,
        pack_ids(tokens),
        start,
        pack_ids(pages),
        last,
        SAMPLING,
        prompt_logprobs=prompt_logprobs,
        restore=restore,
        save=list(save),
    )


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def pages_for(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // PAGE)))


def states(model: Qwen35Model, slot: int) -> list[torch.Tensor]:
    """Every linear-attention layer's recurrent and conv state in ``slot``."""
    out = []
    for gdn in (layer.linear_attention for layer in model.layers if layer.linear_attention):
        out += [gdn.recurrent_state[slot].clone(), gdn.conv_state[slot].clone()]
    return out


@dataclass
class Outcome:
    results: list[TokenResult]  # the prompt's first token, then DECODE_STEPS greedy decodes
    state: list[torch.Tensor]  # right after the prompt's prefill


def decode_on(
    runner: StepRunner, request_id: int, slot: int, first: TokenResult, position: int, pages: list[int]
) -> list[TokenResult]:
    results = [first]
    for step in range(DECODE_STEPS):
        row = DecodeRow(request_id, slot, results[-1].token, position + step, pack_ids(pages), SAMPLING)
        results += runner.decode([row]).results()
    return results


def uninterrupted(reference: Qwen35Model, tokens: list[int]) -> Outcome:
    runner = snapshot_runner(reference)
    pages = pages_for(0, len(tokens) + DECODE_STEPS)
    (first,) = runner.prefill([chunk(1, tokens, 0, pages)]).results
    state = states(reference, runner.requests.requests[1].state_slot)
    return Outcome(decode_on(runner, 1, 0, first, len(tokens), pages), state)


def outcome(
    runner: StepRunner, request_id: int, first: TokenResult, slot: int, length: int, pages: list[int]
) -> Outcome:
    state = states(runner.model, runner.requests.requests[request_id].state_slot)
    return Outcome(decode_on(runner, request_id, slot, first, length, pages), state)


def assert_states_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for got_part, want_part in zip(got, want, strict=True):
        torch.testing.assert_close(got_part, want_part, rtol=1e-4, atol=1e-5)


def assert_same(got: Outcome, want: Outcome) -> None:
    assert_states_equal(got.state, want.state)
    assert [r.token for r in got.results] == [r.token for r in want.results]
    for got_result, want_result in zip(got.results, want.results, strict=True):
        assert got_result.top_ids == want_result.top_ids
        assert got_result.top_logprobs == pytest.approx(want_result.top_logprobs, abs=1e-4)
