"""A prefill command's model work: its restores, then its chunks in waves split at their save points.

A save copies a request's state as it stands after exactly ``position`` prompt tokens, while one
model pass moves every chunk's state to the chunk's end. A pass can leave states behind on its
way, but only on the chunked delta rule's grid, every ``GDN_CHUNK`` tokens from where the chunk
starts in the batch (``kernels/varlen.py``, ``StateCaptures``): a save on that grid is captured
into its snapshot slot in the same pass, and a save at the chunk's end is copied out after it.
Any other save cuts the chunk there into segments: wave k runs segment k of every chunk that has
one (a chunk without such cuts runs whole in wave 0), and after each wave every chunk whose segment
ended at a save has its staging state copied into the save's snapshot slot. Every restore of the
command (snapshot slot -> the request's staging slot) runs before the first wave, so a command may
restore a slot that one of its own saves overwrites. A chunk's logits are those of its last
segment's last token; prompt logprobs come from wave 0, which holds every chunk that asks for them
whole (they save nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.kernels.varlen import GDN_CHUNK
from phalanx.models.qwen35 import PrefillBatch
from phalanx.models.qwen35.parallel import TokenScores
from phalanx.protocol.messages import PromptLogprobs, StateSnapshot
from phalanx.worker.prefill_graphs import PrefillGraphRunner
from phalanx.worker.prompt_scoring import PromptScoring
from phalanx.worker.snapshots import SnapshotTable
from phalanx.worker.step_plans import ChunkPlan


@dataclass(frozen=True)
class Segment:
    """Tokens ``[offset, end)`` of chunk ``index`` of the command."""

    index: int
    offset: int
    end: int
    save: StateSnapshot | None  # copied out once the segment has run (the save's position is its end)
    final: bool  # the chunk's last segment: its last token's logits are the chunk's
    captures: tuple[StateSnapshot, ...] = ()  # saves inside the segment, on the grid: the same pass


def split_waves(plans: list[ChunkPlan]) -> list[list[Segment]]:
    """The segments each wave runs, chunks in command order within a wave."""
    waves: list[list[Segment]] = []
    for index, plan in enumerate(plans):
        for wave, segment in enumerate(_segments(index, plan)):
            if wave == len(waves):
                waves.append([])
            waves[wave].append(segment)
    return waves


def _segments(index: int, plan: ChunkPlan) -> list[Segment]:
    """The chunk cut at its saves that are neither at its end nor on its segment's grid."""
    start, length = plan.chunk.start, len(plan.tokens)
    segments: list[Segment] = []
    offset, captures = 0, []
    for save in plan.chunk.save:  # ascending, inside (start, start + length]
        at = save.position - start
        if at < length and (at - offset) % GDN_CHUNK == 0:
            captures.append(save)
            continue
        segments.append(Segment(index, offset, at, save, at == length, tuple(captures)))
        offset, captures = at, []
    if offset < length:
        segments.append(Segment(index, offset, length, None, True, tuple(captures)))
    return segments


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # float32 [chunks, vocab] at each chunk's last token
    scoring: PromptScoring | None
    scores: TokenScores | None

    def prompt_logprobs(self) -> list[PromptLogprobs]:
        return [] if self.scoring is None else self.scoring.results(self.scores)


def run_prefill(
    model,
    plans: list[ChunkPlan],
    device: torch.device,
    snapshots: SnapshotTable,
    graphs: PrefillGraphRunner | None = None,
) -> PrefillOutput:
    """Restores, then the waves with their saves; the plans are checked (``worker/commands.py``).
    A wave of one short segment replays a prefill graph (``worker/prefill_graphs.py``)."""
    waves = split_waves(plans)
    first = [(plans[s.index].chunk, plans[s.index].tokens[s.offset : s.end]) for s in waves[0]]
    scoring = PromptScoring.plan(first)
    for plan in plans:
        if plan.chunk.restore is not None:
            model.copy_state(snapshots.state_slot(plan.chunk.restore.slot), plan.state.state_slot)
    final: list[torch.Tensor | None] = [None] * len(plans)
    scores = None
    for number, wave in enumerate(waves):
        chunks = [_batch_chunk(plans[s.index], s) for s in wave]
        captures = _captures(plans, wave, snapshots)
        if number == 0 and scoring is not None and scoring.rows:
            batch = PrefillBatch.build(chunks, device, captures)
            logits, scores = model.prefill_scored(batch, *scoring.tensors(device), scoring.top_n)
        else:
            logits = _prefill(model, chunks, device, captures, graphs)
        for row, segment in enumerate(wave):
            if segment.final:
                final[segment.index] = logits[row]
            for captured in segment.captures:
                snapshots.record(captured)
            if segment.save is not None:
                state_slot = plans[segment.index].state.state_slot
                model.copy_state(state_slot, snapshots.state_slot(segment.save.slot))
                snapshots.record(segment.save)
    # One wave holds every chunk whole, in order: its logits are already the chunks'.
    return PrefillOutput(logits if len(waves) == 1 else torch.stack(final), scoring, scores)


def _prefill(
    model,
    chunks: list[tuple[list[int], int, int, list[int]]],
    device: torch.device,
    captures: list[tuple[int, int, int]],
    graphs: PrefillGraphRunner | None,
) -> torch.Tensor:
    """One pass: a lone segment that fits a graph replays it, anything else runs eagerly."""
    if graphs is not None and len(chunks) == 1:
        tokens, start, slot, pages = chunks[0]
        key = graphs.key_for(len(tokens), start, len(pages), len(captures))
        if key is not None:
            saves = [(offset, to) for _, offset, to in captures]
            return graphs.prefill(key, tokens, start, slot, pages, saves)
    return model.prefill(PrefillBatch.build(chunks, device, captures))


def _batch_chunk(plan: ChunkPlan, segment: Segment) -> tuple[list[int], int, int, list[int]]:
    """(tokens, start, state slot, pages) of one segment, as ``PrefillBatch.build`` takes them."""
    tokens = plan.tokens[segment.offset : segment.end]
    return tokens, plan.chunk.start + segment.offset, plan.state.state_slot, plan.pages


def _captures(
    plans: list[ChunkPlan], wave: list[Segment], snapshots: SnapshotTable
) -> list[tuple[int, int, int]]:
    """(batch chunk, tokens into it, snapshot's state slot) of every save the wave captures."""
    return [
        (
            row,
            save.position - plans[segment.index].chunk.start - segment.offset,
            snapshots.state_slot(save.slot),
        )
        for row, segment in enumerate(wave)
        for save in segment.captures
    ]
