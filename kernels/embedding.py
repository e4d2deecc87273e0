"""Token embedding reference: the rows of one rank's vocabulary slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_ref(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """``[T, H]`` in ``weight``'s dtype: row ``token - vocab_start`` of ``weight`` [V, H] for each of
    ``tokens`` [T] (int64) inside ``[vocab_start, vocab_start + V)``, zeros for the others (the
    rows another tensor-parallel rank holds; summed over ranks, each token gets its row)."""
    local = tokens - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    embedded = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return embedded * inside.unsqueeze(-1).to(embedded.dtype)
