"""A prefill command's model work: its restores, then its chunks in waves split at their save points.

A save copies a request's state as it stands after exactly ``position`` prompt tokens, while one
model pass moves every chunk's state to the chunk's end. A save at a multiple of ``GDN_CHUNK``
tokens past the chunk's start is taken inside the pass (the model leaves that state behind on the
way, ``StateCaptures``), and a save at the chunk's end is a copy after it. A chunk with any other
save is cut at its save points into segments, and wave k runs segment k of every chunk that has
one (a chunk without such saves runs whole in wave 0); after each wave, every chunk whose segment
ended at a save point has its staging state copied into the save's snapshot slot. Every restore of the command (snapshot slot -> the
request's staging slot) runs before the first wave, so a command may restore a slot that one of
its own saves overwrites. A chunk's logits are those of its last segment's last token; prompt
logprobs come from wave 0, which holds every chunk that asks for them whole (they save nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.kernels.varlen import GDN_CHUNK
from phalanx.models.qwen35 import PrefillBatch
from phalanx.models.qwen35.parallel import TokenScores
from phalanx.protocol.messages import PromptLogprobs, StateSnapshot
from phalanx.worker.prompt_scoring import PromptScoring
from phalanx.worker.snapshots import SnapshotTable
from phalanx.worker.step_plans import ChunkPlan


@dataclass(frozen=True)
class Segment:
    """Tokens ``[offset, end)`` of chunk ``index`` of the command."""

    index: int
    offset: int
    end: int
    save: StateSnapshot | None  # taken once the segment has run (the save's position is its end)
    final: bool  # the chunk's last segment: its last token's logits are the chunk's
    captures: tuple[StateSnapshot, ...] = ()  # taken inside the segment's pass


def split_waves(plans: list[ChunkPlan]) -> list[list[Segment]]:
    """The segments each wave runs, chunks in command order within a wave."""
    waves: list[list[Segment]] = []
    for index, plan in enumerate(plans):
        start, length = plan.chunk.start, len(plan.tokens)
        saves = {save.position - start: save for save in plan.chunk.save}
        if all(offset % GDN_CHUNK == 0 or offset == length for offset in saves):
            captures = tuple(save for offset, save in saves.items() if offset < length)
            if not waves:
                waves.append([])
            waves[0].append(Segment(index, 0, length, saves.get(length), True, captures))
            continue
        ends = list(saves)
        if not ends or ends[-1] != length:
            ends.append(length)
        offset = 0
        for wave, end in enumerate(ends):
            if wave == len(waves):
                waves.append([])
            waves[wave].append(Segment(index, offset, end, saves.get(end), end == length))
            offset = end
    return waves


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # float32 [chunks, vocab] at each chunk's last token
    scoring: PromptScoring | None
    scores: TokenScores | None

    def prompt_logprobs(self) -> list[PromptLogprobs]:
        return [] if self.scoring is None else self.scoring.results(self.scores)


def run_prefill(
    model, plans: list[ChunkPlan], device: torch.device, snapshots: SnapshotTable
) -> PrefillOutput:
    """Restores, then the waves with their saves; the plans are checked (``worker/commands.py``)."""
    waves = split_waves(plans)
    first = [(plans[s.index].chunk, plans[s.index].tokens[s.offset : s.end]) for s in waves[0]]
    scoring = PromptScoring.plan(first)
    for plan in plans:
        if plan.chunk.restore is not None:
            model.copy_state(snapshots.state_slot(plan.chunk.restore.slot), plan.state.state_slot)
    final: list[torch.Tensor | None] = [None] * len(plans)
    scores = None
    for number, wave in enumerate(waves):
        captures = [
            (row, save.position - plans[s.index].chunk.start - s.offset, snapshots.state_slot(save.slot))
            for row, s in enumerate(wave)
            for save in s.captures
        ]
        batch = PrefillBatch.build([_batch_chunk(plans[s.index], s) for s in wave], device, captures)
        if number == 0 and scoring is not None and scoring.rows:
            logits, scores = model.prefill_scored(batch, *scoring.tensors(device), scoring.top_n)
        else:
            logits = model.prefill(batch)
        for row, segment in enumerate(wave):
            for save in segment.captures:
                snapshots.record(save)
            if segment.final:
                final[segment.index] = logits[row]
            if segment.save is not None:
                state_slot = plans[segment.index].state.state_slot
                model.copy_state(state_slot, snapshots.state_slot(segment.save.slot))
                snapshots.record(segment.save)
    # One wave holds every chunk whole, in order: its logits are already the chunks'.
    return PrefillOutput(logits if len(waves) == 1 else torch.stack(final), scoring, scores)


def _batch_chunk(plan: ChunkPlan, segment: Segment) -> tuple[list[int], int, int, list[int]]:
    """(tokens, start, state slot, pages) of one segment, as ``PrefillBatch.build`` takes them."""
    tokens = plan.tokens[segment.offset : segment.end]
    return tokens, plan.chunk.start + segment.offset, plan.state.state_slot, plan.pages
