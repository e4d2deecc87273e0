"""Greedy token picking reference: every row's argmax, also written to a per-slot token buffer.

A decode step picks each row's greedy token (the first maximal logit, so the smallest id among
ties, as ``torch.argmax`` does) and writes it to ``fed[slot]`` for the row's state slot: a
pipelined next step feeds its rows from there (``protocol.messages.FED_TOKEN``).

With a ``landing`` (a decode graph's pinned ``[2, 1 + rows]`` ring) and the step's sequence number
``seq`` (a one-element int64 tensor on the logits' device), the tokens also land in host memory, so rank 0 reads them
without a copy: ``landing[seq % 2]`` gets ``[seq, tokens...]``.
"""

from __future__ import annotations

import torch


def greedy_pick_ref(
    logits: torch.Tensor,
    slots: torch.Tensor,
    fed: torch.Tensor,
    landing: torch.Tensor | None = None,
    seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [rows, vocab], slots [rows] int64, fed [slots] int64 -> tokens [rows] int64; also
    ``fed[slots[i]] = tokens[i]``, and the landing's half of ``seq`` when given."""
    tokens = torch.argmax(logits, dim=-1)
    fed.index_copy_(0, slots, tokens)
    if landing is not None and seq is not None:
        half = landing[int(seq[0]) % 2]
        half[0] = seq[0]
        half[1 : 1 + tokens.shape[0]] = tokens
    return tokens
