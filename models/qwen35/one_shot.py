"""Small all-reduces through symmetric memory: one kernel that reads every peer's buffer.

Decode all-reduces are tiny (a few rows of the hidden size, 5 KB at batch 1 of the 4B model) and
there are two per layer, so their latency, not bandwidth, is what TP pays. PyTorch's
symmetric-memory one-shot all-reduce (each rank reads its peers' buffers over NVLink and sums) has
less than half NCCL's latency at that size inside a CUDA graph (docs/benchmarks/kernel-choices-h200.md).
Larger messages (prefill, big decode batches) stay on NCCL.

Each rank stages its input in one of two symmetric buffers, alternating (a row-parallel linear
writes its output there directly, saving the copy). The one-shot kernel starts
with a barrier across ranks, so a rank can overwrite a buffer only after every peer has reached
the all-reduce after next, by which time it has finished reading that buffer. Where the
alternation restarts (a new graph replay, an eager step after a graph) an NCCL collective sits in
between (the logits all-gather), which orders the ranks the same way.
"""

from __future__ import annotations

import math

import structlog
import torch
import torch.distributed as dist

from phalanx.config import settings

log = structlog.get_logger(__name__)

# Messages up to this size take the one-shot path; above it NCCL's ring is faster.
ONE_SHOT_MAX_BYTES = 1 << 20


class OneShotAllReduce:
    def __init__(self, dtype: torch.dtype, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffers = []
        for _ in range(2):
            buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, self.group_name)
            self.buffers.append(buffer)
        self.calls = 0

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return dtype == self.dtype and math.prod(shape) <= self.max_numel

    def stage(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The next symmetric buffer, as a contiguous ``shape`` view: write this rank's addend
        there (a row-parallel linear writes its output straight in), then ``reduce`` it."""
        staged = self.buffers[self.calls % 2][: math.prod(shape)]
        self.calls += 1
        return staged.view(shape)

    def reduce(self, staged: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``stage``'s buffer, in a new tensor of its shape."""
        flat = staged.view(-1)
        return torch.ops.symm_mem.one_shot_all_reduce(flat, "sum", self.group_name).view(staged.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.stage(tuple(x.shape))
        staged.copy_(x)
        return self.reduce(staged)


def try_one_shot(
    dtype: torch.dtype, device: torch.device, rank: int, world_size: int
) -> OneShotAllReduce | None:
    """The one-shot path if this process group can use it (CUDA, peers reachable, probe sums
    right), else None: NCCL then carries every all-reduce. ``PHALANX_ALL_REDUCE=nccl`` turns it off."""
    if device.type != "cuda" or world_size == 1 or settings.all_reduce_path() == "nccl":
        return None
    try:
        one_shot = OneShotAllReduce(dtype, device)
        probe = one_shot(torch.full((4,), rank + 1, dtype=dtype, device=device))
        expected = world_size * (world_size + 1) // 2
        if not bool((probe == expected).all()):
            raise RuntimeError(f"probe summed to {probe.tolist()}, expected {expected}")
    except Exception as exc:  # symmetric memory needs P2P between every pair of GPUs
        log.warning(
            "one-shot all-reduce unavailable, NCCL carries all",
            rank=rank,
            error=f"{type(exc).__name__}: {exc}",
        )
        return None
    log.info(
        "one-shot all-reduce for small messages", rank=rank, max_bytes=one_shot.max_numel * dtype.itemsize
    )
    return one_shot
