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

    @property
    def serving(self) -> int:
        """What eager steps need at most (a Unified step is a prefill with decode rows beside it)."""
        return max(self.prefill, self.decode)


def measure_activations(
    model, device: torch.device, max_batch_tokens: int, decode_rows: int
) -> ActivationProfile:
    from phalanx.models.qwen35.batch import DecodeBatch, PrefillBatch

    page_size = 16
    tokens = min(max_batch_tokens, model.config.max_position_embeddings)
    pages = -(-tokens // page_size)
    model.allocate_cache(pages + 1, page_size, 1)
    model.tp.local_only = True
    try:
        prefill = PrefillBatch.build([([0] * tokens, 0, 0, list(range(pages)))], device)
        # Every row decodes position 0 into slot 0 and page 0: the shapes of a full batch.
        decode = DecodeBatch.build([(0, 0, 0, [0])] * decode_rows, device)
        return ActivationProfile(
            prefill=_peak(device, lambda: model.prefill(prefill)),
            decode=_peak(device, lambda: model.decode(decode)),
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
