"""Host tensors onto the GPU without waiting for it.

A copy from pageable host memory (``torch.tensor(values, device=cuda)``, ``cpu_tensor.to(cuda)``)
synchronises the stream first, so the host stops until every kernel already queued has run: a
step's inputs uploaded that way wait for the step still in flight before them, and the overlap of
a pipelined step, or of a Unified step's decode graph with its prefill's launches, is lost. Staged
in pinned memory, the copy joins the stream like a kernel (torch's host allocator keeps the block
until the copy has run)."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; on a CUDA device, copied without a stream sync. On
    the CPU it is ``host`` itself (no copy)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
