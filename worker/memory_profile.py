"""A rank's activation memory, measured on CUDA before its capacity is sized (vLLM's profile run).

After the weights load, the rank runs one prefill of ``max_batch_tokens`` tokens and one eager
decode of the largest batch it may serve on a throwaway cache, and records how far each pushed
the allocator's peak beyond what was allocated before it. The process group does not exist yet,
so the model's collectives are skipped (``TensorParallel.local_only``): the values are
meaningless, the shapes and so the memory are those of serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ActivationProfile:
    prefill: int  # peak bytes beyond the weights and cache over a max_batch_tokens prefill
    decode: int  # the same over an eager decode of the largest batch
    graphed_prefill: int = 0  # the same over the largest graphed prefill (worker/prefill_graphs.py)

    @property
    def serving(self) -> int:
        """What eager steps need at most (a Unified step is a prefill with decode rows beside it)."""
        return max(self.prefill, self.decode)


def measure_activations(
    model, device: torch.device, max_batch_tokens: int, decode_rows: int, graphed_prefill_tokens: int = 0
) -> ActivationProfile:
    """``graphed_prefill_tokens``: the token count of the largest graphed prefill (0: none), whose
    activations the prefill graphs' pool keeps apart from the allocator's."""
    from phalanx.models.qwen35.batch import DecodeBatch, PrefillBatch

    page_size = 16
    tokens = min(max(max_batch_tokens, graphed_prefill_tokens), model.config.max_position_embeddings)
    pages = -(-tokens // page_size)
    model.allocate_cache(pages + 1, page_size, 1)
    model.tp.local_only = True

    def prefill_of(count: int) -> Callable[[], torch.Tensor]:
        count = min(count, tokens)
        batch = PrefillBatch.build([([0] * count, 0, 0, list(range(-(-count // page_size))))], device)
        return lambda: model.prefill(batch)

    try:
        # Every row decodes position 0 into slot 0 and page 0: the shapes of a full batch.
        decode = DecodeBatch.build([(0, 0, 0, [0])] * decode_rows, device)
        return ActivationProfile(
            prefill=_peak(device, prefill_of(max_batch_tokens)),
            decode=_peak(device, lambda: model.decode(decode)),
            graphed_prefill=_peak(device, prefill_of(graphed_prefill_tokens))
            if graphed_prefill_tokens
            else 0,
        )
    finally:
        model.tp.local_only = False
        model.release_cache()
        torch.cuda.empty_cache()


def _peak(device: torch.device, step: Callable[[], torch.Tensor]) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)
